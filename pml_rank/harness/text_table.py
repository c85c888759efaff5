"""The one plain-text table printer of the command line and the example scripts
(pure Python: `pml-rank list` uses it without the harness's dependencies)."""


def format_text_table(header, rows, align=None):
    """`header` and `rows` (lists of cells, converted with str) as aligned text, two
    spaces between columns, trailing spaces stripped. `align` has one letter per column,
    ``"l"`` or ``"r"``; default: the first column left, the others right (numbers)."""
    lines = [[str(cell) for cell in line] for line in [header, *rows]]
    align = align or "l" + "r" * (len(header) - 1)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    pad = {"l": str.ljust, "r": str.rjust}
    return "\n".join("  ".join(pad[a](cell, w) for a, cell, w in zip(align, line, widths)).rstrip() for line in lines)
