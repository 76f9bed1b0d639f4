"""Terminal output shared by the lab's programs: tables that never cut a number, and progress from the first second.

- :func:`console` prints to stdout: the terminal's width in a terminal; plain text as wide as each line needs when
  piped or redirected, so a log of a run keeps every digit.
- :class:`FitTable` is a table that fits the width it is given by dropping its optional columns (least useful
  first) and wrapping text at spaces, never by cutting a cell: a narrow terminal gets a compact layout.
- :class:`Steps` shows what a long command is doing: a rich progress line on a terminal's stderr, or one plain
  line per step with the seconds elapsed when stderr is not a terminal.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

PLAIN_WIDTH = 10_000  # "unlimited" width of piped output: rich wraps nothing and cuts nothing


def console(file: IO[str] | None = None) -> Console:
    """A console on ``file`` (stdout): the terminal's width there, else wide enough for any line."""
    stream = file or sys.stdout
    if stream.isatty():
        return Console(file=stream)
    return Console(file=stream, width=PLAIN_WIDTH, force_terminal=False, color_system=None)


def text_of(renderable: Any, width: int = PLAIN_WIDTH) -> str:
    """``renderable`` as plain text (``width``: the width it is laid out for), trailing spaces stripped."""
    import io

    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False, color_system=None).print(renderable)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


# ------------------------------------------------------------------------------------------------
# Tables that fit
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """One column of a :class:`FitTable`. ``drop``: 0 keeps it always; columns with higher ``drop`` go first when
    the table does not fit."""

    title: str
    justify: str = "right"
    drop: int = 0
    style: str | None = None


class FitTable:
    """A rich table laid out for the width it is rendered at, cutting no cell.

    Columns are kept at the width of their widest cell; text cells may wrap at spaces. When even the
    narrowest layout of every column does not fit, the optional columns are left out, highest ``drop`` first
    (a caption says which); if it still does not fit, cells fold onto a second line rather than lose a digit.
    """

    def __init__(self, columns: Sequence[Column], title: str | None = None, caption: str | None = None,
                 table_box: box.Box | None = box.SIMPLE_HEAD, show_header: bool = True) -> None:
        self.columns = list(columns)
        self.title, self.caption, self.box, self.show_header = title, caption, table_box, show_header
        self.rows: list[tuple[list[Any], str | None, bool]] = []  # (cells, style, section before)
        self._section = False

    def add_row(self, *cells: Any, style: str | None = None) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"add_row takes {len(self.columns)} cells, got {len(cells)}")
        self.rows.append(([c if isinstance(c, Text) else Text(str(c)) for c in cells], style, self._section))
        self._section = False

    def add_section(self) -> None:
        self._section = bool(self.rows)

    def _table(self, keep: list[int], widths: list[int] | None = None) -> Table:
        dropped = [self.columns[i].title for i in range(len(self.columns)) if i not in keep]
        caption = self.caption
        if dropped:
            note = f"(narrow terminal: {', '.join(t or 'bar' for t in dropped)} left out; pipe to a file for all)"
            caption = f"{caption}\n{note}" if caption else note
        table = Table(title=self.title, caption=caption, box=self.box, show_header=self.show_header,
                      title_justify="left", caption_justify="left", title_style="bold")
        for position, index in enumerate(keep):
            column = self.columns[index]
            table.add_column(column.title, justify=column.justify, style=column.style, overflow="fold",  # type: ignore[arg-type]
                             width=None if widths is None else widths[position])
        for cells, style, section in self.rows:
            if section:
                table.add_section()
            table.add_row(*[cells[i] for i in keep], style=style)
        return table

    def _ranges(self, console_: Console, options: ConsoleOptions, keep: list[int]) -> list[tuple[int, int]]:
        """(narrowest, widest) of each kept column: its longest word and its longest line, header included."""
        wide = options.update_width(PLAIN_WIDTH)
        ranges = []
        for index in keep:
            cells = [Text(self.columns[index].title)] + [row[0][index] for row in self.rows]
            measured = [Measurement.get(console_, wide, cell) for cell in cells]
            ranges.append((max(m.minimum for m in measured), max(m.maximum for m in measured)))
        return ranges

    def _layout(self, console_: Console, options: ConsoleOptions) -> Table:
        width = options.max_width
        keep = list(range(len(self.columns)))
        order = sorted((i for i, c in enumerate(self.columns) if c.drop), key=lambda i: (-self.columns[i].drop, -i))
        while True:
            ranges = self._ranges(console_, options, keep)
            overhead = self._table(keep)._extra_width + 2 * len(keep)  # borders and one space of padding each side
            if sum(low for low, _ in ranges) + overhead <= width or not order:
                break
            keep.remove(order.pop(0))
        spare = width - overhead - sum(low for low, _ in ranges)
        if spare < 0:  # nothing fits: rich folds the cells (every column overflows by folding, none by "…")
            return self._table(keep)
        if sum(high for _, high in ranges) + overhead <= width:
            return self._table(keep, [high for _, high in ranges])
        widths = [low for low, _ in ranges]
        while spare > 0:  # widen the wrapped columns one character at a time, the most wrapped first
            wanting = [i for i, (low, high) in enumerate(ranges) if widths[i] < high]
            if not wanting:
                break
            index = max(wanting, key=lambda i: ranges[i][1] - widths[i])
            widths[index] += 1
            spare -= 1
        return self._table(keep, widths)

    def __rich_console__(self, console_: Console, options: ConsoleOptions) -> RenderResult:
        yield self._layout(console_, options)

    def __rich_measure__(self, console_: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console_, options, self._table(list(range(len(self.columns)))))


# ------------------------------------------------------------------------------------------------
# Progress
# ------------------------------------------------------------------------------------------------
class Steps:
    """Progress of a command: ``with Steps(total) as steps: steps.start("what"); ...; steps.advance()``.

    On a terminal: a transient rich progress line on stderr (spinner, step, bar, count, elapsed). Otherwise
    one plain line per ``start`` on stderr, ``[  12.3 s] what``. ``log`` prints a line that stays either way.
    ``enabled=False`` prints nothing.
    """

    def __init__(self, total: int | None = None, description: str = "", enabled: bool = True,
                 file: IO[str] | None = None) -> None:
        self.file = file or sys.stderr
        self.enabled = enabled
        self.total = total
        self.started = time.perf_counter()
        self.live = enabled and self.file.isatty()
        self._progress: Any = None
        self._task: Any = None
        self._description = description

    def __enter__(self) -> Steps:
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total:
                columns += [BarColumn(), MofNCompleteColumn()]
            columns.append(TimeElapsedColumn())
            self._progress = Progress(*columns, console=Console(file=self.file), transient=True)
            self._progress.__enter__()
            self._task = self._progress.add_task(self._description, total=self.total)
        elif self._description:
            self.start(self._description)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None

    def start(self, description: str) -> None:
        """The step now running."""
        self._description = description
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, description=description)
        else:
            print(f"[{time.perf_counter() - self.started:7.1f} s] {description}", file=self.file, flush=True)

    def set_total(self, total: int) -> None:
        """The number of ``advance`` calls the work will make (shows a bar and a count on a terminal)."""
        self.total = total
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def advance(self, steps: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, steps)

    def log(self, line: str) -> None:
        """A line that stays (above the progress line on a terminal)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.file, flush=True)
