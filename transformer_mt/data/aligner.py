"""eflomal's word aligner (the terms extra; Mozilla's translation pipeline aligns with it): links
in both directions, symmetrised by grow-diag. tmt terms aligns words with it, tmt shortlist
sentencepiece pieces."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

Links = set[tuple[int, int]]


def eflomal_aligner() -> Any:
    """eflomal's aligner (ImportError where it is not installed): .align(source, target) -> links
    per pair from lists of tokens; .name says what it is."""
    return Eflomal()


class Eflomal:
    """eflomal's forward and reverse links, symmetrised by grow-diag."""

    def __init__(self) -> None:
        import eflomal

        self.module = eflomal
        version = getattr(eflomal, "__version__", "")
        self.name = f"eflomal {version}".strip() + " (forward and reverse, grow-diag)"

    def align(self, source: list[list[str]], target: list[list[str]]) -> list[Links]:
        with tempfile.TemporaryDirectory(prefix="tmt-align-") as scratch:
            fwd, rev = Path(scratch) / "fwd", Path(scratch) / "rev"
            src = [" ".join(s) + "\n" for s in source]
            tgt = [" ".join(t) + "\n" for t in target]
            self.module.Aligner().align(src, tgt, links_filename_fwd=str(fwd),
                                        links_filename_rev=str(rev))  # fmt: skip
            rows = zip(fwd.read_text().splitlines(), rev.read_text().splitlines(), strict=True)
            return [grow_diag(_links(a), _links(b)) for a, b in rows]


def _links(text: str) -> Links:
    return {(int(i), int(j)) for i, j in (p.split("-") for p in text.split())}


def grow_diag(forward: Links, reverse: Links) -> Links:
    """The intersection of two directions' links, grown by the union's links next to it (Koehn
    et al. 2003's grow-diag): what phrase extraction reads."""
    found, union = forward & reverse, forward | reverse
    added = True
    while added:
        added = False
        for i, j in sorted(found):
            for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1)):
                cand = (i + di, j + dj)
                if cand in union and cand not in found:
                    src_free = all(a != cand[0] for a, _ in found)
                    tgt_free = all(b != cand[1] for _, b in found)
                    if src_free or tgt_free:
                        found.add(cand)
                        added = True
    return found
