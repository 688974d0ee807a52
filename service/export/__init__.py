"""torch.export programs read by psgrad's own strict loader, never by ``torch.export.load``.

``torch.export.load`` unpickles, evaluates and executes parts of an archive; a client's archive
only ever goes through this package: :mod:`.archive` (the zip, under limits), :mod:`.payloads`
(raw tensor bytes), :mod:`.graph` (the signature and the nodes, against the allow-list in
:mod:`.ops`), :mod:`.module` (the module and its dry run on ``meta``) and :mod:`.interpreter`
(which runs the graph node by node: no code is generated from it). :mod:`.batch`
makes the traced batch of one generic where the program allows, so that fast statistics can run
it on whole batches.
"""

from service.export.archive import Archive, ArchiveLimits, read_archive
from service.export.graph import Program, UserInput, parse_program
from service.export.module import (
    Exported,
    ExportLimits,
    build_module,
    dry_run,
    materialise,
    read_program,
)

__all__ = ["Archive", "ArchiveLimits", "ExportLimits", "Exported", "Program", "UserInput",
           "build_module", "dry_run", "materialise", "parse_program", "read_archive",
           "read_program"]
