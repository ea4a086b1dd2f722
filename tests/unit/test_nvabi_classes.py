"""The whole RM class table of tracer/nvabi_names.py against the driver's own definitions, pair by pair.

Two sources outside the code, both in the repository: tests/data/nvidia_classes.json (each id, name
and header as the open driver defines them; its "source" names the upstream files) and the table of
docs/reference/nvidia-ioctl-abi.md section 8. A class renamed, renumbered, added or dropped in the
code, or a header comment that names another class's file, fails here, whichever id it is: the
decoder's names (`RM_ALLOC VOLTA_COMPUTE_A (0xc3c0)`) and the work threshold's categories
(tracer/gpu_work.py) both key on this table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ghostgpu.tracer import nvabi_names
from ghostgpu.tracer.nvabi_names import CONTROL_CLASS_NAMES, NV04_MEMORY, RM_CLASS_NAMES

REPO = Path(__file__).resolve().parents[2]
VECTORS = json.loads((REPO / "tests" / "data" / "nvidia_classes.json").read_text())
DRIVER: list[tuple[int, str, str]] = [(int(c["id"], 16), c["name"], c["header"]) for c in VECTORS["classes"]]
# The one id with two names: NV01_ROOT_CLIENT allocates, NV04_MEMORY names the NV0041 controls.
ALIAS = (NV04_MEMORY, "NV04_MEMORY")


def _doc_table() -> list[tuple[int, str, str]]:
    """docs/reference/nvidia-ioctl-abi.md §8: rows of `| Id | Class | Header | Id | Class | Header |`."""
    text = (REPO / "docs" / "reference" / "nvidia-ioctl-abi.md").read_text()
    start = text.index("\n## 8. RM class ids")
    section = text[start:text.index("\n## ", start + 1)]
    rows: list[tuple[int, str, str]] = []
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].startswith("0x"):
            continue
        for ident, name, header in (cells[:3], cells[3:]):
            rows.append((int(ident, 16), name, header))
    return rows


def test_the_vectors_are_the_whole_table() -> None:
    ids = [i for i, _, _ in DRIVER]
    assert len(DRIVER) == len(RM_CLASS_NAMES) + 1 == 96
    assert len(set(ids)) == len(ids) - 1  # 0x41 alone appears twice
    assert all(0 <= i < 1 << 16 and re.fullmatch(r"[A-Z][A-Z0-9_]+", n) for i, n, _ in DRIVER)


@pytest.mark.parametrize(("h_class", "name", "header"), DRIVER, ids=[n for _, n, _ in DRIVER])
def test_each_driver_class_has_its_name_in_the_code(h_class: int, name: str, header: str) -> None:
    if (h_class, name) == ALIAS:
        assert CONTROL_CLASS_NAMES[h_class] == name and RM_CLASS_NAMES[h_class] == "NV01_ROOT_CLIENT"
        return
    assert RM_CLASS_NAMES.get(h_class) == name, f"{h_class:#06x} is {name} ({header})"
    assert CONTROL_CLASS_NAMES[h_class] == (name if h_class != NV04_MEMORY else ALIAS[1])


def test_the_code_names_no_class_the_driver_does_not() -> None:
    driver = {(i, n) for i, n, _ in DRIVER}
    assert set(RM_CLASS_NAMES.items()) | {ALIAS} == driver
    assert set(CONTROL_CLASS_NAMES.items()) | {(NV04_MEMORY, "NV01_ROOT_CLIENT")} == driver
    # No name on two ids (a copy-paste rename would leave one id with another's name).
    names = list(RM_CLASS_NAMES.values())
    assert len(set(names)) == len(names)


def test_the_reference_page_lists_the_same_pairs_and_headers() -> None:
    doc = _doc_table()
    assert sorted(doc) == sorted((i, n, h.removeprefix("class/")) for i, n, h in DRIVER)


def test_each_header_is_the_file_of_its_id() -> None:
    """class/clXXXX.h carries the id in its name (nvos.h holds the client and event classes)."""
    for h_class, name, header in DRIVER:
        if header == "nvos.h":
            assert name in {"NV01_ROOT_CLIENT", "NV01_EVENT_KERNEL_CALLBACK", "NV01_EVENT_OS_EVENT",
                            "NV01_EVENT_KERNEL_CALLBACK_EX"}, name
        else:
            assert header == f"class/cl{h_class:04x}.h", (name, header)


def test_the_code_cites_each_class_header() -> None:
    """Each `0xXXXX: "NAME",  # header` line of nvabi_names.py names the header the driver defines it in."""
    source = Path(nvabi_names.__file__).read_text()
    body = source[source.index("RM_CLASS_NAMES: dict"):source.index("NV04_MEMORY = ")]
    cited = {(int(i, 16), n): h for i, n, h in re.findall(r'(0x[0-9A-Fa-f]+): "(\w+)",\s+# (\S+)', body)}
    assert len(cited) == len(RM_CLASS_NAMES)
    assert cited == {(i, n): h.removeprefix("class/") for i, n, h in DRIVER if (i, n) != ALIAS}


@pytest.mark.parametrize(("h_class", "renamed"), [(0xC3C0, "VOLTA_COMPUTE_B"), (0x0040, "NV01_MEMORY_LOCAL"),
                                                  (0xCEC0, "BLACKWELL_COMPUTE_A")])
def test_a_renamed_class_is_caught(monkeypatch: pytest.MonkeyPatch, h_class: int, renamed: str) -> None:
    """The checks above fail for a one-entry rename (the mutation that once went unnoticed)."""
    monkeypatch.setitem(RM_CLASS_NAMES, h_class, renamed)
    with pytest.raises(AssertionError):
        test_the_code_names_no_class_the_driver_does_not()
    row = next(r for r in DRIVER if r[0] == h_class)
    with pytest.raises(AssertionError):
        test_each_driver_class_has_its_name_in_the_code(*row)
