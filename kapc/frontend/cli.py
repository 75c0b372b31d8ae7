"""`kapc prior ...`: make prior.json files from HotpotQA / SQuAD with the offline frontend, or from
other frontends' outputs. A typer sub-app (`prior_app`); mounted by kapc.cli."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated

import typer

prior_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Make prior.json files: from HotpotQA or SQuAD with kapc's offline "
    "retrieval frontend, or from HippoRAG, GraphRAG, LightRAG or plain "
    "scored passages.",
)

OutOpt = Annotated[
    Path | None,
    typer.Option("-o", "--output", help="Where to write prior.json (default: standard output)."),
]
QuestionOpt = Annotated[
    str | None,
    typer.Option("--question", help="The question, when the input file does not carry it."),
]
InstructionOpt = Annotated[
    str | None,
    typer.Option(
        "--instruction", help="The system instruction (default: answer briefly from the passages)."
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="The model whose tokenizer and chat template count the context tokens: a "
        "name (smollm2-135m-instruct, the default; qwen2.5-coder-0.5b-instruct) or a local Hugging "
        "Face folder.",
    ),
]
FrontendOpt = Annotated[
    str,
    typer.Option(
        "--frontend",
        help="graph (sparse + dense + fusion + entity-graph PPR), fusion, dense or bm25.",
    ),
]
GraphOpt = Annotated[
    str,
    typer.Option(
        "--graph",
        help="Graph frontend setting: default (kapc's, measured in benchmarks/records/frontend-recall/: "
        "passage node weight 0.5, second-hop node units from the 2 best passages) or hipporag2 "
        "(HippoRAG 2's: passage node weight 0.05, the 100 highest-PPR node units).",
    ),
]
TokensOpt = Annotated[
    int,
    typer.Option(
        "--context-tokens",
        "-n",
        help="Target prompt length in model tokens (chat template "
        "included); the prompt is the longest that fits.",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for the order of hard negatives.")]
IndexOpt = Annotated[
    int | None, typer.Option("--index", "-i", help="Question index in the dev file.")
]
IdOpt = Annotated[str | None, typer.Option("--id", help="Question id in the dev file.")]


def _graph_config(name: str):
    from kapc.frontend import graph
    from kapc.frontend.errors import FrontendError

    if name not in graph.CONFIGS:
        raise FrontendError(f"unknown --graph {name!r}; choose one of {', '.join(graph.CONFIGS)}")
    return graph.CONFIGS[name]


def _friendly(fn):
    """Report kapc's own errors as one line on stderr and exit 1 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from kapc import settings
        from kapc.errors import KapcError
        from kapc.models import ModelError
        from kapc.prior import PriorError

        try:
            return fn(*args, **kwargs)
        except (KapcError, PriorError, ModelError) as exc:
            if settings.debug():
                raise
            from rich.console import Console

            Console(stderr=True, highlight=False).print(
                f"[bold red]kapc: error:[/] {exc}", markup=True, soft_wrap=True
            )
            raise typer.Exit(1) from None

    return wrapper


def _write(prior, output: Path | None) -> None:
    from kapc.prior import encode_prior

    data = encode_prior(prior)
    if output is None:
        sys.stdout.write(data.decode() + "\n")
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(data + b"\n")
    passages = sum(1 for u in prior.units if u.kind == "passage")
    other = len(prior.units) - passages
    from rich.console import Console

    Console(stderr=True, highlight=False).print(
        f"wrote {output}: {passages} passages, {other} graph units ({prior.frontend.name})",
        soft_wrap=True,
    )


def _pick(index: int | None, qid: str | None) -> None:
    from kapc.frontend.errors import FrontendError

    if (index is None) == (qid is None):
        raise FrontendError("give exactly one of --index or --id")


def _instruction(instruction: str | None) -> str:
    from kapc.frontend.prompt import DEFAULT_INSTRUCTION

    return instruction or DEFAULT_INSTRUCTION


@prior_app.command("hotpotqa")
@_friendly
def hotpotqa_cmd(
    index: IndexOpt = None,
    id: IdOpt = None,
    context_tokens: TokensOpt = 4096,
    frontend: FrontendOpt = "graph",
    seed: SeedOpt = 0,
    model: ModelOpt = None,
    graph: GraphOpt = "default",
    output: OutOpt = None,
) -> None:
    """A HotpotQA dev (distractor) question as a long-context prompt, scored by the offline
    frontend: its own 10 paragraphs, then BM25-ranked hard negatives up to --context-tokens."""
    from kapc.frontend.hybrid import hotpotqa_prior
    from kapc.frontend.progress import status

    _pick(index, id)
    with status("building and scoring the HotpotQA prompt"):
        prior = hotpotqa_prior(
            index,
            context_tokens,
            qid=id,
            frontend=frontend,
            seed=seed,
            model=model,
            graph_config=_graph_config(graph),
        )
    _write(prior, output)


@prior_app.command("squad")
@_friendly
def squad_cmd(
    index: IndexOpt = None,
    id: IdOpt = None,
    context_tokens: TokensOpt = 4096,
    frontend: FrontendOpt = "graph",
    seed: SeedOpt = 0,
    model: ModelOpt = None,
    graph: GraphOpt = "default",
    output: OutOpt = None,
) -> None:
    """A SQuAD 2.0 dev question as a long-context prompt: its paragraph, then BM25-ranked
    paragraphs from the rest of the dev set up to --context-tokens."""
    from kapc.frontend.hybrid import squad_prior
    from kapc.frontend.progress import status

    _pick(index, id)
    with status("building and scoring the SQuAD prompt"):
        prior = squad_prior(
            index,
            context_tokens,
            qid=id,
            frontend=frontend,
            seed=seed,
            model=model,
            graph_config=_graph_config(graph),
        )
    _write(prior, output)


FileArg = Annotated[Path, typer.Argument(help="The frontend's output, as JSON.")]


@prior_app.command("from-hipporag")
@_friendly
def from_hipporag_cmd(
    file: FileArg,
    output: OutOpt = None,
    question: QuestionOpt = None,
    index: Annotated[
        int, typer.Option("--index", help="Which query solution, when the file holds a list.")
    ] = 0,
    instruction: InstructionOpt = None,
) -> None:
    """HippoRAG 2's retrieval result (QuerySolution: question, docs, doc_scores) as a prior."""
    from kapc.frontend.adapters import adapt_file

    _write(
        adapt_file(
            "hipporag", file, question=question, index=index, instruction=_instruction(instruction)
        ),
        output,
    )


@prior_app.command("from-graphrag")
@_friendly
def from_graphrag_cmd(
    file: FileArg,
    output: OutOpt = None,
    question: QuestionOpt = None,
    instruction: InstructionOpt = None,
) -> None:
    """Microsoft GraphRAG local-search context data (entities, relationships, sources) as a
    prior."""
    from kapc.frontend.adapters import adapt_file

    _write(
        adapt_file("graphrag", file, question=question, instruction=_instruction(instruction)),
        output,
    )


@prior_app.command("from-lightrag")
@_friendly
def from_lightrag_cmd(
    file: FileArg,
    output: OutOpt = None,
    question: QuestionOpt = None,
    instruction: InstructionOpt = None,
) -> None:
    """LightRAG query data (entities, relationships, chunks) as a prior."""
    from kapc.frontend.adapters import adapt_file

    _write(
        adapt_file("lightrag", file, question=question, instruction=_instruction(instruction)),
        output,
    )


@prior_app.command("from-passages")
@_friendly
def from_passages_cmd(
    file: FileArg,
    output: OutOpt = None,
    question: QuestionOpt = None,
    instruction: InstructionOpt = None,
) -> None:
    """A plain list of scored passages ([{id, title, text, scores}]) and a question as a prior."""
    from kapc.frontend.adapters import adapt_file

    _write(
        adapt_file("passages", file, question=question, instruction=_instruction(instruction)),
        output,
    )


if __name__ == "__main__":
    prior_app()
