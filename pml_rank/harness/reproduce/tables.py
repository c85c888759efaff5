"""The papers' tables as the example scripts declare them: `PaperTable` and `paper_rows`,
which keeps each number as the paper prints it."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class PaperTable:
    """A table as the paper prints it, in percent. ``rows`` maps the paper's row label to
    one number per metric (None where the paper has none)."""

    source: str  # "Gajić et al., CVPR-W 2022, supplementary, table 1"
    metrics: tuple  # the papers' column names: "R@1", "NMI", "P@1", "RP", "MAP@R"
    rows: dict


def paper_rows(text):
    """Rows of a paper table written as in the paper, one per line: ``label | 58.19 |
    86.36``; a cell may be ``68.13 ± 0.31`` (mean and confidence interval), or ``-`` / ``x``
    where the paper has no number (``x``: the run diverged)."""
    rows = {}
    for line in text.strip().splitlines():
        label, *cells = [c.strip() for c in line.split("|")]
        rows[label] = tuple(_paper_cell(c) for c in cells)
    return rows


class PaperNumber(float):
    """A number as the paper prints it: compares as a float, prints as written ("90.0")."""

    def __new__(cls, text):
        number = super().__new__(cls, text.strip().rstrip("?"))
        number.text = text.strip()
        return number

    def __str__(self):
        return self.text


def _paper_cell(cell):
    if cell == "x":
        return "x (diverged)"
    if cell in ("-", "—"):
        return None
    if "±" in cell:
        mean, ci = cell.split("±")
        return (PaperNumber(mean), PaperNumber(ci))
    return PaperNumber(cell)
