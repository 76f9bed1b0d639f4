"""Terminal output shared by the lab's programs: tables that never cut a number, and progress from the first second.

- :func:`console` prints to stdout: the terminal's width in a terminal; plain text as wide as each line needs when
  piped or redirected (no trailing spaces), so a log of a run keeps every digit.
- :class:`FitTable` is a table that fits the width it is given by shortening its titles, then leaving out its
  columns (least useful first), and wrapping text at spaces, never by cutting a number or a name: a narrow terminal
  gets a compact layout and a line saying what was left out.
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
    """A console on ``file`` (stdout): the terminal's width there, else wide enough for any line, each line written
    without the trailing spaces rich pads a table's cells with."""
    stream = file or sys.stdout
    if stream.isatty():
        return Console(file=stream)
    return Console(file=_Trimmed(stream), width=PLAIN_WIDTH, force_terminal=False, color_system=None)


def terminal_width() -> int:
    """The width of the terminal the user sees: ``COLUMNS`` where set, else rich's detection (the terminal on stdin,
    stdout or stderr; 115 in Jupyter; 80 where there is none)."""
    return Console().width


class _Trimmed:
    """A text stream writing each line to ``stream`` without its trailing spaces; spaces at the end of a line not yet
    ended wait for what follows them."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            self.stream.write("\n".join(line.rstrip(" ") for line in lines) + "\n")
        return len(text)

    def flush(self) -> None:
        kept = self._pending.rstrip(" ")
        if kept:
            self.stream.write(kept)
            self._pending = self._pending[len(kept):]
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, ...: the stream's
        return getattr(self.stream, name)


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
    """One column of a :class:`FitTable`. ``drop``: 0 keeps it always; columns with higher ``drop`` go first when the
    table does not fit. ``short``: a shorter title, used before any column is left out. ``wrap``: False keeps each
    cell on one line (say "+1.2 %"); text cells otherwise wrap at spaces."""

    title: str
    justify: str = "right"
    drop: int = 0
    style: str | None = None
    short: str | None = None
    wrap: bool = True


@dataclass(frozen=True)
class Fit:
    """How a :class:`FitTable` is laid out at one width: the columns ``kept`` and ``dropped`` (indices), whether the
    ``short`` titles are used, and the content width of each kept column (None: even the columns it always keeps do
    not fit; rich folds their cells)."""

    kept: list[int]
    short: bool
    widths: list[int] | None
    dropped: list[int]


class FitTable:
    """A rich table laid out for the width it is rendered at, never cutting a number or a name.

    Columns are kept at the width of their widest cell; text cells wrap at spaces only, so every word (a number, a
    variant name) stays whole on one line. When even the narrowest layout does not fit, the table first uses its
    columns' short titles, then leaves columns out, highest ``drop`` first (the rightmost of equal ``drop`` first),
    and says so in one line under the table. Only when the columns it always keeps do not fit even so do cells fold.
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

    def _title(self, index: int, short: bool) -> str:
        column = self.columns[index]
        return column.short if short and column.short is not None else column.title

    def _table(self, fit: Fit) -> Table:
        table = Table(title=self.title, caption=self.caption, box=self.box, show_header=self.show_header,
                      title_justify="left", caption_justify="left", title_style="bold")
        for position, index in enumerate(fit.kept):
            column = self.columns[index]
            table.add_column(self._title(index, fit.short), justify=column.justify, style=column.style,  # type: ignore[arg-type]
                             overflow="fold", no_wrap=not column.wrap,
                             width=None if fit.widths is None else fit.widths[position])
        for cells, style, section in self.rows:
            if section:
                table.add_section()
            table.add_row(*[cells[i] for i in fit.kept], style=style)
        return table

    def _overhead(self, columns: int) -> int:
        """Borders and padding of a table of ``columns`` columns (rich's ``Table._extra_width`` + a space each side)."""
        edges = (2 + columns - 1) if self.box else 0
        return edges + 2 * columns

    def fit(self, console_: Console, width: int) -> Fit:
        """The layout at ``width``: see the class."""
        wide = console_.options.update_width(PLAIN_WIDTH)

        def measure(texts: list[Any]) -> tuple[int, int]:
            measured = [Measurement.get(console_, wide, text) for text in texts]
            return max((m.minimum for m in measured), default=0), max((m.maximum for m in measured), default=0)

        n = len(self.columns)
        body = [measure([row[0][i] for row in self.rows]) for i in range(n)]
        body = [(high, high) if not c.wrap else (low, high) for c, (low, high) in zip(self.columns, body, strict=True)]
        heads = {short: [measure([Text(self._title(i, short))] if self.show_header else []) for i in range(n)]
                 for short in (False, True)}
        ranges = {short: [(max(b[0], h[0]), max(b[1], h[1])) for b, h in zip(body, heads[short], strict=True)]
                  for short in (False, True)}
        order = sorted((i for i, c in enumerate(self.columns) if c.drop), key=lambda i: (-self.columns[i].drop, -i))
        has_short = any(c.short is not None for c in self.columns)
        keep = list(range(n))
        while True:
            for short in (False, True) if has_short else (False,):
                low = sum(ranges[short][i][0] for i in keep)
                if low + self._overhead(len(keep)) <= width:
                    return self._widths(keep, short, [ranges[short][i] for i in keep], width)
            if not order:
                return Fit(keep, has_short, None, [i for i in range(n) if i not in keep])
            keep.remove(order.pop(0))

    def _widths(self, keep: list[int], short: bool, ranges: list[tuple[int, int]], width: int) -> Fit:
        dropped = [i for i in range(len(self.columns)) if i not in keep]
        spare = width - self._overhead(len(keep)) - sum(high for _, high in ranges)
        if spare >= 0:
            return Fit(keep, short, [high for _, high in ranges], dropped)
        widths = [low for low, _ in ranges]
        spare = width - self._overhead(len(keep)) - sum(widths)
        while spare > 0:  # widen the wrapped columns one character at a time, the most wrapped first
            wanting = [i for i, (low, high) in enumerate(ranges) if widths[i] < high]
            if not wanting:
                break
            index = max(wanting, key=lambda i: ranges[i][1] - widths[i])
            widths[index] += 1
            spare -= 1
        return Fit(keep, short, widths, dropped)

    def note(self, fit: Fit, width: int) -> str | None:
        """One line (at most ``width`` characters where any wording fits) saying what a narrow layout changed."""
        short = fit.short and any(self.columns[i].short is not None for i in fit.kept)
        names = list(dict.fromkeys(self.columns[i].short or self.columns[i].title or "bar" for i in fit.dropped))
        if not names:
            return "(narrow terminal: short titles; pipe to a file for full titles)" if short else None
        head = "(narrow terminal: " + ("short titles; " if short else "")
        wordings = [f"{head}{', '.join(names)} left out; pipe to a file for all)",
                    f"{head}{', '.join(names)} left out)"]
        wordings += [f"{head}{', '.join(names[:k])} and {len(names) - k} more left out)"
                     for k in range(len(names) - 1, 0, -1)]
        wordings.append(f"{head}{len(names)} column{'s' if len(names) > 1 else ''} left out)")
        return next((w for w in wordings if len(w) <= width), wordings[-1])

    def __rich_console__(self, console_: Console, options: ConsoleOptions) -> RenderResult:
        fit = self.fit(console_, options.max_width)
        yield self._table(fit)
        note = self.note(fit, options.max_width)
        if note:
            yield Text(note, style="dim italic")

    def __rich_measure__(self, console_: Console, options: ConsoleOptions) -> Measurement:
        n = len(self.columns)
        return Measurement.get(console_, options, self._table(Fit(list(range(n)), False, None, [])))


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
