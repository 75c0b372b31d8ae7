from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode


class KapSnapshot(SingleFileSnapshotExtension):
    """One readable `.kap` file per snapshot, reviewed as a diff."""

    file_extension = "kap"
    _write_mode = WriteMode.TEXT


class TextSnapshot(SingleFileSnapshotExtension):
    file_extension = "txt"
    _write_mode = WriteMode.TEXT
