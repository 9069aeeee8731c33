"""The docs say only what the code does (issue 8, item 2); CPU only.

- every public name (``cupaged.__all__``, ``cupaged.reference.__all__``, the
  public functions and classes of ``cupaged.autotune``) appears in
  docs/api.md, and every name docs/api.md gives a section exists;
- every signature block in docs/api.md matches ``inspect.signature`` (names,
  kinds, defaults), and so does every ``method(...)`` span of a class section;
- every public function and class (and their public methods) has a docstring,
  cupaged.autotune's public functions and classes included;
- the exceptions documented for ``decode`` are real (cupaged's own live in
  cupaged.errors), agree with ``decode.__doc__``, and a few documented raises
  are spot-checked;
- README's two set-up commands are there, and .ci/run runs README's test
  command exactly;
- every relative link (and in-page anchor) in README.md and docs/ resolves;
- every example in docs/api.md runs (those that use CuPy only on a GPU).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import cupaged
import cupaged.autotune
import cupaged.errors
import cupaged.testing
from cupaged import reference

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
DOC_FILES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

SPAN = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
EXC_NAME = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception)$")


# ----------------------------------------------------------------------- parsing
@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    heading: str | None  # text of the heading it sits under
    first: bool  # the first thing after its heading (a signature block)


@dataclass
class Section:
    level: int
    title: str
    line: int
    body: str  # text up to the next heading of the same or a higher level, fences removed


def parse_md(text: str) -> tuple[list[Section], list[Block], str]:
    """Headings as sections, fenced blocks, and the text without its fences."""
    lines = text.splitlines()
    heads: list[tuple[int, str, int]] = []  # (level, title, index into prose)
    blocks: list[Block] = []
    prose: list[str] = []
    heading, pending = None, False
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if fence:
            marker, lang = fence.group(1), fence.group(2)
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(marker):
                j += 1
            blocks.append(Block(lang, "\n".join(lines[i + 1 : j]), i + 1, heading, pending))
            pending = False
            prose.append("")
            i = j + 1
            continue
        m = HEADING.match(line)
        if m:
            heading, pending = m.group(2), True
            heads.append((len(m.group(1)), m.group(2), len(prose)))
        elif line.strip():
            pending = False
        prose.append(line)
        i += 1
    sections = []
    for k, (level, title, start) in enumerate(heads):
        end = next((s for lv, _, s in heads[k + 1 :] if lv <= level), len(prose))
        sections.append(Section(level, title, start + 1, "\n".join(prose[start + 1 : end])))
    return sections, blocks, "\n".join(prose)


def slug(title: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading (duplicates get -1, -2, ...)."""
    s = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
    n = seen.get(s, 0)
    seen[s] = n + 1
    return s if n == 0 else f"{s}-{n}"


def anchors(path: Path) -> set[str]:
    sections, _, _ = parse_md(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    return {slug(s.title, seen) for s in sections}


API_TEXT = API.read_text(encoding="utf-8")
SECTIONS, BLOCKS, API_PROSE = parse_md(API_TEXT)


def heading_name(title: str) -> str | None:
    """``cupaged.X`` when a heading's first code span names an object."""
    m = SPAN.search(title)
    if m and re.fullmatch(r"cupaged(\.\w+)+", m.group(1)):
        return m.group(1)
    return None


def resolve(dotted: str):
    """The object a dotted ``cupaged...`` name refers to (AttributeError if none)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: k + 1]))
    return obj


def section(name: str) -> Section:
    for s in SECTIONS:
        if heading_name(s.title) == name:
            return s
    raise AssertionError(f"docs/api.md has no section for {name}")


def documented_names() -> set[str]:
    """Leading dotted identifier of every code span (headings included) and
    every word of a heading."""
    names = set()
    for span in SPAN.findall(API_PROSE):
        m = re.match(r"[A-Za-z_][\w.]*", span.strip())
        if m:
            names.add(m.group(0).rstrip("."))
    for s in SECTIONS:
        names.update(re.findall(r"[A-Za-z_][\w.]*\w", s.title))
    return names


def raises_names(text: str) -> list[str]:
    """Exception names in the ``**Raises:**`` paragraphs of ``text``."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        for m in re.finditer(r"\*\*Raises:?\*\*:?(.*?)(?=\n\*\*|\Z)", para, re.S):
            out += [s for s in SPAN.findall(m.group(1)) if EXC_NAME.match(s)]
    return out


# ------------------------------------------------------------------ public names
def _autotune_public() -> list[str]:
    mod = cupaged.autotune
    own = {n for n, o in vars(mod).items()
           if not n.startswith("_") and (inspect.isfunction(o) or inspect.isclass(o)) and o.__module__ == mod.__name__}
    assert own <= set(mod.__all__), f"public but not in cupaged.autotune.__all__: {own - set(mod.__all__)}"
    return sorted(mod.__all__)  # graph_time_us is cupaged.testing's, re-exported


@pytest.mark.parametrize("name", cupaged.__all__)
def test_public_name_in_api_md(name):
    names = documented_names()
    assert name in names or f"cupaged.{name}" in names, f"{name} (cupaged.__all__) is not in docs/api.md"


@pytest.mark.parametrize(
    "qualified",
    [f"cupaged.reference.{n}" for n in reference.__all__] + [f"cupaged.autotune.{n}" for n in _autotune_public()]
    + [f"cupaged.testing.{n}" for n in cupaged.testing.__all__],
)
def test_submodule_name_in_api_md(qualified):
    assert qualified in documented_names(), f"{qualified} is not in docs/api.md"


def test_every_documented_section_exists():
    named = [heading_name(s.title) for s in SECTIONS if heading_name(s.title)]
    assert len(named) >= 25
    for name in named:
        try:
            resolve(name)
        except (AttributeError, ImportError):
            pytest.fail(f"docs/api.md documents {name}, which does not exist")


# -------------------------------------------------------------------- signatures
def _doc_signature(line: str) -> list[tuple[str, object, str | None]]:
    """``name(a, b=1, *, c=None)`` -> [(name, kind, default source)]."""
    fn = ast.parse(f"def {line}: pass").body[0]
    a = fn.args
    P = inspect.Parameter
    out = []
    positional = [(x, P.POSITIONAL_ONLY) for x in a.posonlyargs] + [(x, P.POSITIONAL_OR_KEYWORD) for x in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out += [(x.arg, kind, d and ast.unparse(d)) for (x, kind), d in zip(positional, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, P.VAR_POSITIONAL, None))
    out += [(x.arg, P.KEYWORD_ONLY, d and ast.unparse(d)) for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, P.VAR_KEYWORD, None))
    return out


def _check_signature(obj, line: str, where: str) -> None:
    sig = inspect.signature(obj)
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    doc = _doc_signature(line)
    assert [(n, k) for n, k, _ in doc] == [(p.name, p.kind) for p in params], (
        f"{where}: docs/api.md says {line!r}, the code has {sig}"
    )
    for (n, _, d), p in zip(doc, params):
        if p.default is inspect.Parameter.empty:
            assert d is None, f"{where}: {n} has no default in the code, docs/api.md gives {d}"
            continue
        assert d is not None, f"{where}: {n} defaults to {p.default!r} in the code, docs/api.md gives none"
        value = eval(d, {"np": np, "numpy": np, "math": math})  # noqa: S307 (our own docs)
        assert value is p.default or value == p.default, f"{where}: {n}={d} in docs/api.md, {p.default!r} in the code"


def _signature_cases():
    cases = []
    for s in SECTIONS:
        name = heading_name(s.title)
        if name is None:
            continue
        first = [b for b in BLOCKS if b.heading == s.title and b.first]
        cases.append(pytest.param(name, first[0].code.strip() if first else None, id=name))
    return cases


@pytest.mark.parametrize("name, line", _signature_cases())
def test_signature_block_matches_code(name, line):
    obj = resolve(name)
    short = name.rsplit(".", 1)[1]
    if line is None:
        assert not inspect.isroutine(obj), f"{name} is a function: give its signature first in its section"
        return
    assert "\n" not in line, f"{name}: a signature block holds one line"
    m = re.fullmatch(rf"{short}\s*=\s*(.+)", line)
    if m:  # a constant
        assert eval(m.group(1), {"np": np, "numpy": np, "math": math}) == obj, name  # noqa: S307
        return
    assert line.startswith(short + "("), f"{name}: signature block {line!r} names another object"
    _check_signature(obj, line, name)


def _method_cases():
    cases = []
    for s in SECTIONS:
        name = heading_name(s.title)
        try:
            cls = resolve(name) if name else None
        except (AttributeError, ImportError):
            continue  # test_every_documented_section_exists reports it
        if not inspect.isclass(cls):
            continue
        for span in dict.fromkeys(x.strip() for x in SPAN.findall(s.body)):
            m = re.fullmatch(r"(\w+)\((.*)\)", span)
            if m and inspect.isroutine(getattr(cls, m.group(1), None)) and m.group(1) in vars(cls):
                cases.append(pytest.param(cls, span, id=f"{name}.{span}"))
    return cases


@pytest.mark.parametrize("cls, span", _method_cases())
def test_method_spans_match_code(cls, span):
    method = span.split("(", 1)[0]
    _check_signature(getattr(cls, method), span, f"{cls.__name__}.{method}")


def test_method_spans_found():
    assert len(_method_cases()) >= 14  # PageTable, BlockPool and DecodePlan methods


# -------------------------------------------------------------------- docstrings
def _own_doc(obj) -> str:
    """The object's own docstring; an auto-generated dataclass/NamedTuple one
    (``Name(field, ...)``) counts as none."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    name = getattr(obj, "__name__", None)
    if inspect.isclass(obj) and name and doc.startswith(f"{name}("):
        return ""
    return doc


def _public_callables():
    out = []
    for name in cupaged.__all__:
        obj = getattr(cupaged, name)
        if inspect.isclass(obj) or callable(obj):
            out.append(pytest.param(obj, id=name))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(member, (classmethod, staticmethod)):
                        member = member.__func__
                    if inspect.isfunction(member) or isinstance(member, property):
                        out.append(pytest.param(member, id=f"{name}.{attr}"))
        elif inspect.ismodule(obj):
            out.append(pytest.param(obj, id=name))
    out += [pytest.param(getattr(reference, n), id=f"reference.{n}") for n in reference.__all__
            if callable(getattr(reference, n))]
    out += [pytest.param(getattr(cupaged.autotune, n), id=f"autotune.{n}") for n in _autotune_public()]
    out += [pytest.param(getattr(cupaged.testing, n), id=f"testing.{n}") for n in cupaged.testing.__all__
            if callable(getattr(cupaged.testing, n))]
    return out


def test_public_callables_cover_submodules():
    ids = {p.id for p in _public_callables()}
    assert {f"autotune.{n}" for n in ("tune", "tuned_plan", "graph_time_us", "TuneResult")} <= ids
    assert {f"reference.{n}" for n in ("decode", "merge_states", "decode_split")} <= ids
    assert {f"testing.{n}" for n in ("make_paged_batch", "graph_time_us", "GraphTimer", "benchmark_graph")} <= ids


@pytest.mark.parametrize("obj", _public_callables())
def test_public_object_has_docstring(obj):
    assert _own_doc(obj), f"{obj!r} has no docstring of its own"


@pytest.mark.parametrize("fn", [cupaged.decode, cupaged.merge_states], ids=["decode", "merge_states"])
def test_help_is_enough_to_call(fn):
    doc = fn.__doc__
    for part in ("Args:", "Returns:", "Raises:", "Example", "log2"):
        assert part in doc, f"{fn.__name__}.__doc__ lacks {part!r}"


# -------------------------------------------------------------------- exceptions
def _is_exception(name: str) -> bool:
    if "." in name:
        try:
            obj = resolve(name)
        except (AttributeError, ImportError):
            return False
    else:
        obj = getattr(builtins, name, None) or getattr(cupaged.errors, name, None)
    return inspect.isclass(obj) and issubclass(obj, BaseException)


def test_decode_raises_are_real_classes():
    names = raises_names(section("cupaged.decode").body)
    assert names, "docs/api.md documents no exceptions for decode"
    for name in names:
        if hasattr(builtins, name):
            assert issubclass(getattr(builtins, name), BaseException), name
            continue
        cls = getattr(cupaged.errors, name, None)
        assert inspect.isclass(cls), f"decode documents {name}, which is not a class in cupaged.errors"
        assert issubclass(cls, cupaged.errors.CupagedError), name
        assert getattr(cupaged, name) is cls and name in cupaged.__all__, f"{name} is not exported by cupaged"


def test_decode_raises_agree_with_docstring():
    documented = set(raises_names(section("cupaged.decode").body))
    raises = cupaged.decode.__doc__.split("Raises:", 1)[1].split("Example", 1)[0]
    in_docstring = set(re.findall(r"\b[A-Z]\w*Error\b", raises))
    assert documented == in_docstring


def test_every_documented_exception_exists():
    names = raises_names(API_PROSE)
    assert len(names) > 20
    missing = sorted({n for n in names if not _is_exception(n)})
    assert not missing, f"docs/api.md names exceptions that do not exist: {missing}"


def test_errors_table_matches_hierarchy():
    rows = re.findall(r"^\|\s*`(\w+)`\s*\|\s*`(\w+)`\s*\|", section_by_title("Errors").body, re.M)
    assert {r[0] for r in rows} == {n for n in cupaged.__all__ if n.endswith("Error")}
    for name, base in rows:
        cls = getattr(cupaged.errors, name)
        assert issubclass(cls, getattr(builtins, base)), f"{name} is documented as a {base}"
        assert issubclass(cls, cupaged.errors.CupagedError)


def section_by_title(title: str) -> Section:
    return next(s for s in SECTIONS if s.title == title)


def test_documented_raises_spot_checks():
    """A few documented raises, on the CPU."""
    with pytest.raises(cupaged.PageTableError, match="last_page_len"):
        cupaged.PageTable([0], [0, 1], [5], page_size=4)
    with pytest.raises(ValueError):  # PageTableError is a ValueError, as documented
        cupaged.PageTable.from_seq_lens([-1], 4)
    pool = cupaged.BlockPool(4, 4)
    s = pool.add_sequence()
    with pytest.raises(cupaged.OutOfPagesError):
        pool.append(s, 100)
    assert pool.num_free == 4 and pool.sequence(s).length == 0
    with pytest.raises(MemoryError):
        pool.append(s, 100)
    with pytest.raises(KeyError):
        pool.append(12345, 1)
    table = cupaged.PageTable.from_seq_lens([70], 16)
    plan = cupaged.plan_decode(table, 8, 2, 64, "float16", pages_per_chunk=1)
    other = cupaged.PageTable.from_seq_lens([90], 16)
    with pytest.raises(cupaged.PlanMismatchError):
        plan.chunk_token_ranges(other)
    k = np.zeros((8, 16, 2, 64), np.float16)
    with pytest.raises(cupaged.PlanMismatchError):
        reference.decode_split(np.zeros((1, 8, 64), np.float16), k, k, other, plan)
    with pytest.raises(ValueError, match="batch size 0"):
        cupaged.plan_decode(cupaged.PageTable.from_seq_lens([], 16), 8, 2, 64, "float16")
    with pytest.raises(ValueError, match="exactly|end at N"):
        reference.merge_states(np.zeros((3, 1, 4)), np.zeros((3, 1)), np.array([0, 2]))
    if not cupaged.has_gpu():
        for call in (lambda: cupaged.decode(None, None, None, table),
                     lambda: cupaged.merge_states(None, None, None),
                     table.device):
            with pytest.raises(cupaged.NoGPUError):
                call()


def test_docstring_raises_spot_checks(monkeypatch):
    """Raises that the docstrings (issue 8 item 2) name, on the CPU."""
    table = cupaged.PageTable.from_seq_lens([70], 16)
    monkeypatch.setenv("CUPAGED_TARGET_CTAS", "lots")  # read whenever target_ctas is None
    with pytest.raises(ValueError, match="CUPAGED_TARGET_CTAS"):
        cupaged.plan_decode(table, 8, 2, 64, "float16", pages_per_chunk=2)
    cupaged.plan_decode(table, 8, 2, 64, "float16", target_ctas=4)  # not read with a target
    monkeypatch.delenv("CUPAGED_TARGET_CTAS")
    monkeypatch.setenv("CUPAGED_NUM_SMS", "0")
    cupaged.plan_decode(table, 8, 2, 64, "float16", num_sms=4)  # not read with num_sms
    if not cupaged.has_gpu():
        with pytest.raises(ValueError, match="CUPAGED_NUM_SMS"):
            cupaged.plan_decode(table, 8, 2, 64, "float16")
    monkeypatch.delenv("CUPAGED_NUM_SMS")
    assert cupaged.plan_decode(table, 8, 2, 96, "float16").head_dim == 96  # planned; no kernel for it
    for page_size in (0, 65537, 4.0):
        with pytest.raises(ValueError):
            cupaged.BlockPool(4, page_size)
    pool = cupaged.BlockPool(4, 4)
    s = pool.add_sequence()
    pool.append(s, 15)
    for bad in (lambda: pool.add_sequence(s), lambda: pool.append(s, -1), lambda: pool.refcount(4),
                lambda: pool.trim_front(s, 16), lambda: pool.apply_window(s, -1)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(cupaged.OutOfPagesError):
        pool.fork(s)  # the partial last page needs a copy, and no page is free
    assert pool.seq_ids == (s,) and pool.num_free == 0
    cache = np.zeros((4, 2))
    for copies in ([(-1, 0)], [(0, 4)], [(1.0, 2)]):
        with pytest.raises(ValueError):
            cupaged.apply_page_copies(cache, copies)
    with pytest.raises(cupaged.InvalidArgumentError):  # a ValueError, as on the kernels' path
        reference.gather_kv(np.zeros((8, 16, 2, 64)), table, 1)
    k = np.zeros((8, 16, 2, 64))
    with pytest.raises(cupaged.PageTableError):
        reference.decode(np.zeros((1, 4, 64)), k[:2], k[:2], table)  # 5 pages, 2 in the cache
    with pytest.raises(ValueError, match="divisible"):
        reference.attend(np.zeros((3, 64)), k[0], k[0])


@pytest.mark.skipif(cupaged.has_gpu(), reason="checks the no-GPU behaviour")
def test_autotune_without_gpu_raises_cupy_error():
    """autotune has no GPU check of its own: CuPy's CUDA error surfaces."""
    cupy = pytest.importorskip("cupy")
    import cupaged.autotune as autotune

    table = cupaged.PageTable.from_seq_lens([100], 16)
    q, k = np.zeros((1, 8, 64), np.float16), np.zeros((7, 16, 2, 64), np.float16)
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
        autotune.tune(q, k, k, table, store=False)
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
        autotune.tuned_plan(q, k, k, table)


def test_lse_units_documented():
    for text in (section_by_title("Conventions").body, section("cupaged.decode").body,
                 section("cupaged.merge_states").body):
        assert "log2" in text


# -------------------------------------------------------------- README and CI
def _bash_lines(text: str) -> list[str]:
    _, blocks, _ = parse_md(text)
    return [ln.strip() for b in blocks if b.lang in ("bash", "sh", "shell", "console") for ln in b.code.splitlines()]


def _editable_target(words: list[str]) -> str:
    return words[words.index("-e") + 1]


def test_readme_has_both_setup_commands():
    lines = _bash_lines(README.read_text(encoding="utf-8"))
    demo = [ln for ln in lines if "pip install -e" in ln and ln.endswith("python -m cupaged demo")]
    tests = [ln for ln in lines if "pip install -e" in ln and ln.endswith("python -m pytest -q")]
    assert len(demo) == 1, "README needs one command: pip install -e ... python -m cupaged demo"
    assert len(tests) == 1, "README needs one command: pip install -e ... python -m pytest -q"
    # both install CuPy through an extra that pyproject.toml declares (CuPy is no plain dependency)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for line in (demo[0], tests[0]):
        target = _editable_target(shlex.split(line.split("&&")[2]))
        wanted = set(re.findall(r"\[(.*)\]", target)[0].split(",")) if "[" in target else set()
        assert "cuda13" in wanted and wanted <= set(extras), (line, sorted(extras))


def test_ci_runs_readme_test_command():
    ci = [ln.strip() for ln in CI_RUN.read_text(encoding="utf-8").splitlines()
          if ln.strip() and not ln.strip().startswith("#")]
    pytest_lines = [ln.split(" #")[0].strip() for ln in ci if "pytest" in ln.split()]
    readme_text = README.read_text(encoding="utf-8")
    readme = next(ln for ln in _bash_lines(readme_text) if "pytest" in ln)
    steps = [s.strip() for s in readme.split("&&")]
    assert pytest_lines and pytest_lines[0] == steps[-1], f".ci/run runs {pytest_lines[:1]!r}, README {steps[-1]!r}"
    # then only the marked compile check, as README gives it (deselected from the main command)
    assert pytest_lines[1:] == ["python -m pytest -q -m compile"], pytest_lines
    assert f"`{pytest_lines[1]}`" in readme_text
    # and installs the same extras as README's command
    ci_pip = next(shlex.split(ln) for ln in ci if "pip" in ln and "-e" in shlex.split(ln))
    readme_pip = next(shlex.split(s) for s in steps if s.split()[:2] == ["pip", "install"])
    assert _editable_target(ci_pip) == _editable_target(readme_pip)


# ------------------------------------------------------------------------ links
def _links(path: Path) -> list[str]:
    _, _, prose = parse_md(path.read_text(encoding="utf-8"))
    # drop code spans (a `[x](y)` there is no link), but keep those that are a link's text
    prose = re.sub(r"``[^`]*``|`[^`\n]*`", lambda m: m.group(0) if prose[m.end():m.end() + 1] == "]" else "", prose)
    found = LINK.findall(prose)
    found += [m.group(1) for ln in prose.splitlines() if (m := REF_DEF.match(ln))]
    return found


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in _links(path):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{path.relative_to(ROOT)}: broken relative links {broken}"


def test_link_parser_sees_links():
    assert "docs/architecture.md" in _links(README)
    assert "architecture.md" in _links(API)
    assert "#cupagedpagetable" in _links(API)


# --------------------------------------------------------------------- examples
def _example_cases():
    cases = []
    for b in BLOCKS:
        if b.lang != "python" or b.first:
            continue
        marks = [pytest.mark.gpu] if re.search(r"\bcupy\b", b.code) else []
        cases.append(pytest.param(b.code, id=f"api.md:{b.line}", marks=marks))
    return cases


@pytest.mark.parametrize("code", _example_cases())
def test_api_example_runs(code, monkeypatch, tmp_path):
    for var in ("CUPAGED_DECODE", "CUPAGED_CORE", "CUPAGED_TARGET_CTAS", "CUPAGED_NUM_SMS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    exec(compile(code, str(API), "exec"), {"__name__": "api_example"})  # noqa: S102 (our own docs)


def test_examples_found():
    cases = _example_cases()
    assert len(cases) >= 12
    assert sum(not c.marks for c in cases) >= 8  # most run on the CPU


def test_architecture_opens_with_the_current_module_map():
    """docs/architecture.md's module map (issue 19) is what the code imports:
    scripts/module_map.py reads every module's package imports; a stale
    table fails here (fix: scripts/module_map.py --write)."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import module_map

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert text.index("## Module map") < text.index("## Data flow")
    assert module_map.doc_table(text) == module_map.render()


def test_module_map_finds_cycles_and_lazy_imports():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import module_map

    found = module_map.imports()
    assert "plan" in found["_validate"][1] and "_validate" in found["plan"][0]  # the cycle, broken lazily
    with pytest.raises(ValueError, match="cycle"):
        module_map.depths({"a": ({"b"}, set()), "b": ({"a"}, set())})
    assert module_map.depths({"a": ({"b"}, set()), "b": (set(), {"a"})}) == {"a": 1, "b": 0}
