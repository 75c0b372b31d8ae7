"""A catalogue of bad inputs, each with the message a user gets for it.

Every case runs the real command line (`kapc.cli.main`, in process, so that its error handling is
what is tested) on a file made for the case, and checks three things: the exit status, that the
message says what is wrong and where (a JSON path, file:line:col, or the reason a plan is refused),
and that nothing reaches the user as a traceback or an "internal error". Inputs that look odd but
are valid (emoji, right-to-left text, NUL, empty passages, a UTF-8 byte-order mark) must compile.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

from kapc.cli import main
from tests.conftest import EXAMPLES
from tests.fuzz import kapb_tools

PRIOR = EXAMPLES / "hotpotqa" / "q0000-700.prior.json"
BASE = json.loads(PRIOR.read_text())


def kapc(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["kapc", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def refused(args, *expected: str) -> str:
    code, out, err = kapc(*args)
    assert code == 1, (code, out, err)
    assert "internal error" not in err and "Traceback" not in err, err
    flat = " ".join(err.split())
    for text in expected:
        assert " ".join(text.split()) in flat, (text, err)
    return err


def compiles(args) -> None:
    code, out, err = kapc(*args)
    assert code == 0, err


def write_json(tmp_path: Path, doc, name="prior.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def prior_with(change) -> dict:
    doc = copy.deepcopy(BASE)
    change(doc)
    return doc


def passages(doc) -> list[dict]:
    return [
        s for m in doc["request"]["messages"] for s in m["segments"] if s.get("kind") == "passage"
    ]


def drop_units_of(doc, seg_id: str) -> None:
    for u in doc["units"]:
        u["anchors"] = [a for a in u.get("anchors", []) if a["segment"] != seg_id]
    doc["units"] = [
        u
        for u in doc["units"]
        if (u["kind"] == "passage" and u["segment"] != seg_id) or u.get("anchors")
    ]


# ---- prior.json -----------------------------------------------------------------------------

PRIOR_CASES = {
    "malformed JSON": ('{"name": "x", "request": ', ["not valid JSON", "line 1, column"]),
    "not an object": ("[1, 2]", ["Expected `object`, got `array` - at `$`"]),
    "wrong type deep inside": (
        prior_with(lambda d: d["units"][0].update(kind=5)),
        ["$.units[0].kind"],
    ),
    "unknown field": (prior_with(lambda d: d.update(extra=1)), ["unknown field `extra`", "$"]),
    "lone surrogate": (
        json.dumps(BASE).replace('"text": "', '"text": "\\ud800', 1),
        ["not valid JSON", "surrogate", "line 1"],
    ),
    "anchor out of range": (
        prior_with(
            lambda d: next(u for u in d["units"] if u["anchors"])["anchors"][0].update(end=10**9)
        ),
        ["anchors[0]", "outside passage"],
    ),
    "infinite score": (
        json.dumps(BASE).replace('"scores": {"', '"scores": {"huge": 1e999, "', 1),
        ['$.units[0].scores["huge"]', "Number out of range"],
    ),
    "duplicate segment id": (
        prior_with(lambda d: passages(d)[1].update(id=passages(d)[0]["id"])),
        ["duplicate segment id"],
    ),
    "duplicate unit id": (
        prior_with(lambda d: d["units"][1].update(id=d["units"][0]["id"])),
        ["$.units[1].id: duplicate unit id"],
    ),
    "id ending in a newline": (
        prior_with(lambda d: d["units"][0].update(id="u0\n")),
        ["$.units[0].id"],
    ),
    "message without segments": (
        prior_with(lambda d: d["request"]["messages"].append({"role": "user", "segments": []})),
        ["$.request.messages[", "].segments"],
    ),
    "passage without id": (prior_with(lambda d: passages(d)[0].pop("id")), ["needs an `id`"]),
    "future version": (prior_with(lambda d: d.update(version=7)), ["$.version", "newer"]),
    "deeply nested": (
        json.dumps(BASE)[:-1] + ', "meta": {"x": ' + "[" * 50_000 + "]" * 50_000 + "}}",
        ["nested deeper", "line 1, column"],
    ),
}


@pytest.mark.parametrize("case", PRIOR_CASES, ids=str)
def test_bad_prior(case, tmp_path):
    doc, expected = PRIOR_CASES[case]
    path = write_json(tmp_path, doc)
    err = refused(["compile", path, "-o", tmp_path / "p.kapb"], *expected)
    assert str(path) in err
    assert not (tmp_path / "p.kapb").exists()


def test_utf16_prior_is_refused_by_name(tmp_path):
    path = tmp_path / "prior.json"
    path.write_bytes(PRIOR.read_text().encode("utf-16"))
    refused(["compile", path, "-o", tmp_path / "p.kapb"], "UTF-16", "save it as UTF-8")


def test_100_mb_prior_is_refused_by_size(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(100 << 20)  # sparse: no 100 MB written to disk
    refused(["compile", path, "-o", tmp_path / "p.kapb"], "larger than the 64 MiB")


def test_prompt_longer_than_the_model_is_refused_before_tokenizing(tmp_path):
    def huge(d):
        passages(d)[0]["text"] = "word " * 2_000_000  # 10 MB: no 8K-token model holds it
        drop_units_of(d, passages(d)[0]["id"])

    refused(
        ["compile", write_json(tmp_path, prior_with(huge)), "-o", tmp_path / "p.kapb"],
        "characters fit",
    )


def test_prompt_over_the_context_is_refused(tmp_path):
    def long(d):
        passages(d)[0]["text"] = "a b c d " * 4000  # ~16K tokens
        drop_units_of(d, passages(d)[0]["id"])

    refused(
        ["compile", write_json(tmp_path, prior_with(long)), "-o", tmp_path / "p.kapb"],
        "longer than",
        "context of 8192",
    )


@pytest.mark.parametrize(
    "text",
    ["", "a\u0000b", "🤖 שלום e\u0301 \u200f", "line\u2028sep\u0085x\x0c"],
    ids=["empty", "NUL", "emoji-rtl-combining", "separators"],
)
def test_odd_but_valid_passages_compile(text, tmp_path):
    def odd(d):
        passages(d)[1]["text"] = text
        drop_units_of(d, passages(d)[1]["id"])

    out = tmp_path / "p.kapb"
    compiles(
        [
            "compile",
            write_json(tmp_path, prior_with(odd)),
            "-o",
            out,
            "--emit-kap",
            tmp_path / "p.kap",
        ]
    )
    compiles(["fmt", "--check", tmp_path / "p.kap"])  # and the emitted .kap reads back
    assert out.exists()


def test_utf8_bom_prior_compiles(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + PRIOR.read_bytes())
    compiles(["compile", path, "-o", tmp_path / "p.kapb"])


@pytest.mark.parametrize(
    "passes,expected",
    [
        ("ground,align-spans,select{budget-tokens=1},resolve-pages,compact", "below the"),
        (
            "ground,align-spans,select{budget-tokens=1000000},resolve-pages,compact",
            "not below the prompt",
        ),
        (
            "ground,align-spans,select{budget-ratio=0},resolve-pages,compact",
            "budget-ratio must be within",
        ),
        (
            "ground,align-spans,select{budget-ratio=nan},resolve-pages,compact",
            "not a finite number",
        ),
        ("compact{accept=top99}", "compact: accept must be"),
        ("ground{norm=bogus}", "ground: norm must be"),
        ("compact{max-retained=7}", "compact: max-retained must be within"),
        ("compact{acceptance-window=-5}", "compact: acceptance-window must be within"),
        ("resolve-pages{block-size=0}", "resolve-pages: block-size must be within"),
        ("compact{k=" + "9" * 5000 + "}", "...("),
        ("ground,selct", "did you mean 'select'"),
    ],
)
def test_bad_pipelines(passes, expected, tmp_path):
    refused(["compile", PRIOR, "-o", tmp_path / "p.kapb", "--passes", passes], expected)


def test_pipeline_options_are_checked_before_the_input_is_read(tmp_path):
    # the input does not exist: an option error must still be the one reported
    refused(
        [
            "compile",
            tmp_path / "missing.json",
            "-o",
            tmp_path / "p.kapb",
            "--passes",
            "compact{accept=top99}",
        ],
        "compact: accept must be",
    )


# ---- .kap -------------------------------------------------------------------------------------

HEAD = 'kap name="x" request=chat\n'
KAP_CASES = {
    "unterminated string": (
        HEAD + 'segment %a role=user text="abc\n',
        ":2:",
        "unterminated string",
    ),
    "unexpected character": (HEAD + "segment %a role=user ! \n", ":2:22:", "unexpected character"),
    "unexpected token": (HEAD + 'segment %a role=user text="q" }\n', ":2:", "unexpected '}'"),
    "end of file": (HEAD + "segment %a role=", ":2:", "unexpected end of file"),
    "unknown statement": (HEAD + "segmnt %a\n", ":2:1:", "did you mean 'segment'"),
    "unknown attribute": (HEAD + 'segment %a role=user txt="q"\n', ":2:", "did you mean 'text'"),
    "wrong type": (HEAD + "segment %a role=user text=3\n", ":2:", "expected a string"),
    "attribute twice": (HEAD + 'segment %a role=user text="q" text="r"\n', ":2:", "given twice"),
    "map key twice": (
        HEAD + "unit %u kind=passage scores={a=1.0, a=2.0}\n",
        ":2:37:",
        "key 'a' given twice",
    ),
    "missing attribute": (HEAD + "segment %a role=user\n", ":2:1:", "missing 'text'"),
    "second header": (HEAD + HEAD, ":2:1:", "a second 'kap' statement"),
    "no header": ('segment %a role=user text="q"\n', ":1:1:", "starts with a `kap` statement"),
    "future version": ('kap version=99 name="x" request=chat\n', ":1:1:", "newer than this kapc"),
    "huge integer": (
        HEAD + "prompt chars=1 tokens=" + "9" * 5000 + ' hash="h"\n',
        ":2:",
        "at most 64 bits",
    ),
    "non-finite number": (HEAD + "unit %u kind=passage scores={a=1e999}\n", ":2:", "finite number"),
    "lone surrogate": (HEAD + 'segment %a role=user text="\\ud800"\n', ":2:", "lone surrogate"),
    "checker: unknown pass": (
        'kap name="x" request=chat passes=[ground, bogus]\n',
        ":1:1:",
        "unknown pass 'bogus'",
    ),
    "checker: statements missing": (
        'kap name="x" request=chat passes=[ground, align-spans]\n',
        ":1:1:",
        "no 'target' statement",
    ),
    "checker: zero block size": (None, ":", "block size 0"),
    "checker: zero prompt tokens": (None, ":", "0 tokens, outside"),
    "checker: window out of domain": (None, ":", "acceptance_window -5"),
}


def _staged(text_change) -> str:
    text = (Path(__file__).resolve().parents[2] / "plans" / "q0000-small.5-compact.kap").read_text()
    return text_change(text)


STAGED = {
    "checker: zero block size": lambda t: t.replace("block_size=16", "block_size=0"),
    "checker: zero prompt tokens": lambda t: re.sub(
        r"(prompt chars=\d+) tokens=\d+", r"\1 tokens=0", t
    ),
    "checker: window out of domain": lambda t: t.replace(
        "acceptance_window=32", "acceptance_window=-5"
    ),
}


@pytest.mark.parametrize("case", KAP_CASES, ids=str)
def test_bad_kap(case, tmp_path):
    text, where, expected = KAP_CASES[case]
    if text is None:
        text = _staged(STAGED[case])
    path = tmp_path / "bad.kap"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    for args in (["fmt", "--check", path], ["compile", path, "-o", tmp_path / "p.kapb"]):
        err = refused(args, expected)
        assert f"{path}{where}" in err, err


def test_non_utf8_kap_points_at_the_character(tmp_path):
    path = tmp_path / "latin1.kap"
    path.write_bytes('kap name="\u00e9'.encode() + b'\xff" request=chat\n')
    refused(["fmt", "--check", path], f"{path}:1:12:", "not UTF-8: byte 0xff")


def test_line_separators_do_not_move_the_caret(tmp_path):
    path = tmp_path / "sep.kap"
    path.write_text(
        HEAD + 'segment %a role=user text="x\u2028y\u0085z\x0c" bad\n', encoding="utf-8"
    )
    err = refused(["fmt", "--check", path], f"{path}:2:")
    shown = err.split("\n")
    caret_line = next(i for i, line in enumerate(shown) if line.strip().startswith("^"))
    assert "segment %a" in shown[caret_line - 1]  # the source line shown is the one at fault


def test_long_bad_value_is_not_echoed_whole(tmp_path):
    path = tmp_path / "long.kap"
    path.write_text(HEAD + "x" * 100_000 + "\n")
    err = refused(["fmt", "--check", path], "unknown statement")
    assert len(err) < 2000


@pytest.mark.parametrize(
    ("where", "path"),
    [
        (lambda d, v: d["units"][0].__setitem__("kind", v), "$.units[0].kind"),
        (
            lambda d, v: d["request"]["messages"][0].__setitem__("role", v),
            "$.request.messages[0].role",
        ),
        (lambda d, v: d["units"][0].__setitem__("scores", {v: "high"}), '$.units[0].scores["'),
    ],
    ids=["enum-value", "role", "dict-key"],
)
def test_long_bad_prior_value_is_cut_and_its_path_kept(tmp_path, where, path):
    """msgspec quotes the offending value or key whole; the message cuts it and says how long."""
    doc = copy.deepcopy(BASE)
    where(doc, "x" * 100_000)
    prior = tmp_path / "long.prior.json"
    prior.write_text(json.dumps(doc))
    err = refused(["compile", prior, "-o", tmp_path / "p.kapb"], path, "(100000 chars)")
    assert len(err) < 400, err


def test_oversized_kap_is_refused(tmp_path):
    path = tmp_path / "many.kap"
    path.write_text(HEAD + "".join(f'segment %s{i} role=user text="t"\n' for i in range(130_000)))
    refused(["fmt", "--check", path], "more than 500,000 tokens")


# ---- .kapb ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_bytes(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("plan") / "p.kapb"
    compiles(["compile", PRIOR, "-o", out])
    return out.read_bytes()


def _boundaries(data: bytes) -> list[int]:
    header, arrays = kapb_tools.split(data)
    _, head_len, _ = kapb_tools.unseal(data)
    cuts = {0, 7, 8, 12, 16, 24, 55, 56, 56 + head_len // 2, 56 + head_len, len(data) - 1}
    for _, _, offset, count in header["arrays"]:
        cuts |= {offset, offset + 2 * count, offset + 4 * count - 1}
    return sorted(c for c in cuts if 0 <= c < len(data))


def test_kapb_truncated_at_every_section_boundary(plan_bytes, tmp_path):
    for cut in _boundaries(plan_bytes):
        path = tmp_path / f"cut{cut}.kapb"
        path.write_bytes(plan_bytes[:cut])
        refused(["inspect", path], str(path), "truncated" if cut >= 8 or cut == 0 else "truncated")


def test_kapb_flipped_bytes(plan_bytes, tmp_path):
    for at in (0, 9, 20, 40, 60, len(plan_bytes) // 2, len(plan_bytes) - 1):
        data = bytearray(plan_bytes)
        data[at] ^= 0x40
        path = tmp_path / f"flip{at}.kapb"
        path.write_bytes(bytes(data))
        refused(["inspect", path], str(path))


@pytest.mark.parametrize(
    "change,expected",
    [
        (lambda h, a: a["prompt_token_ids"].append(7), "prompt token ids"),
        (lambda h, a: a["selected_blocks"].reverse(), "selected_blocks must ascend"),
        (lambda h, a: a["positions"].pop(), "positions are not"),
        (lambda h, a: h.update(prompt_tokens=h["prompt_tokens"] + 1), "prompt"),
        (lambda h, a: h.update(block_size=0), "block_size 0"),
        (lambda h, a: h.update(accept="top99"), "acceptance rule"),
        (lambda h, a: h["fallback"].update(acceptance_window=-5), "acceptance_window"),
    ],
)
def test_kapb_sealed_but_inconsistent(plan_bytes, tmp_path, change, expected):
    header, arrays = kapb_tools.split(plan_bytes)
    change(header, arrays)
    path = tmp_path / "bad.kapb"
    path.write_bytes(kapb_tools.build(header, arrays))
    refused(["inspect", path], "inconsistent plan", expected)


def test_kapb_negative_offset_and_huge_length(plan_bytes, tmp_path):
    header, arrays = kapb_tools.split(plan_bytes)
    header["arrays"][1][2] = -64
    path = tmp_path / "neg.kapb"
    path.write_bytes(kapb_tools.build(header, arrays, relayout=False))
    refused(["inspect", path], "outside the file's array area")
    header, arrays = kapb_tools.split(plan_bytes)
    header["arrays"][0][3] = 2**40
    path.write_bytes(kapb_tools.build(header, arrays, relayout=False))
    refused(["inspect", path], "outside the file's array area")


def test_kapb_future_version(plan_bytes, tmp_path):
    _, head_len, body = kapb_tools.unseal(plan_bytes)
    path = tmp_path / "future.kapb"
    path.write_bytes(kapb_tools.reseal(body, head_len, version=9))
    refused(["inspect", path], "format version 9 is newer", "upgrade kapc")


@pytest.mark.model
@pytest.mark.parametrize(
    "field,expected",
    [
        ("model_fingerprint", "compiled for another model"),
        ("prompt_hash", "inconsistent plan"),  # a hash that is not the ids' is refused at reading
    ],
)
def test_kapb_for_another_model_or_prompt(plan_bytes, tmp_path, field, expected):
    header, arrays = kapb_tools.split(plan_bytes)
    header[field] = "sha256:" + "0" * 64
    path = tmp_path / "other.kapb"
    path.write_bytes(kapb_tools.build(header, arrays))
    refused(["run", path, "--max-tokens", "2"], expected)


# ---- every command: missing, directory, empty, wrong kind, unwritable ------------------------

INPUT_COMMANDS = {
    "compile": lambda p, t: ["compile", p, "-o", t / "o.kapb"],
    "explain": lambda p, t: ["explain", p],
    "inspect": lambda p, t: ["inspect", p],
    "fmt": lambda p, t: ["fmt", "--check", p],
    "run": lambda p, t: ["run", p],
}


@pytest.mark.parametrize("command", INPUT_COMMANDS)
@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "wrong kind"])
def test_every_command_on_bad_input_files(command, kind, tmp_path, plan_bytes):
    if kind == "missing":
        path = tmp_path / ("nope.kap" if command == "fmt" else "nope.json")
        expected = "No such file"
    elif kind == "directory":
        path = tmp_path / "adir"
        path.mkdir()
        (path / "x.kap").write_text("kap")  # fmt reads a folder's .kap files; this one is bad
        expected = "directory" if command != "fmt" else "x.kap"
    elif kind == "empty":
        path = tmp_path / ("empty.kap" if command == "fmt" else "empty.json")
        path.write_bytes(b"")
        expected = str(path)
    else:
        # a .kapb where text is expected, and a prior where a plan is expected
        if command in ("inspect", "run"):
            path = write_json(tmp_path, BASE, "plan.kapb")
            expected = "not a .kapb file"
        else:
            path = tmp_path / ("plan.kap" if command == "fmt" else "plan.json")
            path.write_bytes(plan_bytes)
            expected = str(path)
    refused(INPUT_COMMANDS[command](path, tmp_path), expected)


@pytest.mark.parametrize("where", ["missing dir", "a directory", "under a file", "unwritable"])
@pytest.mark.parametrize("option", ["-o", "--emit-kap"])
def test_unwritable_outputs_are_refused_before_compiling(where, option, tmp_path):
    if where == "missing dir":
        target = tmp_path / "no" / "such" / "p.out"
    elif where == "a directory":
        target = tmp_path / "outdir"
        target.mkdir()
    elif where == "under a file":
        (tmp_path / "afile").write_text("x")
        target = tmp_path / "afile" / "p.out"
    elif os.geteuid() == 0:
        target = Path("/sys/kapc-test.out")  # root ignores permission bits; sysfs refuses files
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        target = ro / "p.out"
    args = ["compile", PRIOR, "-o", tmp_path / "ok.kapb", "--emit-kap", tmp_path / "ok.kap"]
    args[args.index(option) + 1] = target
    refused(args, option, str(target))
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert not (tmp_path / "ok.kapb").exists()  # nothing written when one output is bad


@pytest.mark.parametrize(
    "args,expected",
    [
        (["compile"], "Missing argument"),
        (["compile", PRIOR, "--no-such-option"], "No such option: --no-such-option"),
        (["bench"], "Missing option '--out'"),
        (["no-such-command"], "No such command"),
        (["compile", PRIOR, "--block-size", "many"], "Invalid value for '--block-size'"),
    ],
)
def test_usage_errors_are_usage_errors(args, expected):
    code, out, err = kapc(*args)
    assert code == 2, (code, out, err)
    assert "internal error" not in err and "Traceback" not in err, err
    assert expected in err, err


@pytest.mark.parametrize("args", [[], ["schema"], ["prior"]])
def test_a_bare_command_shows_its_help(args):
    code, out, err = kapc(*args)
    assert "internal error" not in err, err
    assert "Usage" in out + err and "Commands" in out + err, (out, err)
