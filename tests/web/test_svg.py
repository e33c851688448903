"""gpuflex.web.svg: the plots are well-formed SVG, put each value where it belongs, and
escape the users' text."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from gpuflex.web import svg

NS = "{http://www.w3.org/2000/svg}"


def parse(text: str) -> ET.Element:
    return ET.fromstring(text)   # raises on anything that is not well-formed XML


def rects(root: ET.Element, cls: str) -> list[ET.Element]:
    return [r for r in root.iter(f"{NS}rect") if r.get("class") == cls]


def test_stacked_columns_stack_the_fractions_and_mark_the_reclaims():
    cols = [{"start": 0.0, "end": 10.0, "busy": 0.5, "harvested": 0.25, "idle": 0.25, "reclaimed": 0},
            {"start": 10.0, "end": 20.0, "busy": 0.0, "harvested": 0.0, "idle": 1.0, "reclaimed": 2}]
    root = parse(svg.stacked_columns(cols, ("busy", "harvested", "idle"), marker="reclaimed", label="pool"))
    busy, = rects(root, "busy")
    harvested, = rects(root, "harvested")
    idle = rects(root, "idle")
    assert len(idle) == 2 and not [r for r in rects(root, "busy") if r is not busy]
    # busy at the bottom, harvested right above it, half and a quarter of the same height
    assert abs(float(busy.get("height")) - 2 * float(harvested.get("height"))) < 0.2
    assert abs(float(harvested.get("y")) + float(harvested.get("height")) - float(busy.get("y"))) < 0.2
    marks = rects(root, "reclaimed")
    assert len(marks) == 1 and "2 reclaimed" in marks[0].find(f"{NS}title").text
    assert float(marks[0].get("x")) > float(busy.get("x"))   # over the second column


def test_step_line_steps_through_the_sizes_and_draws_each_mark():
    root = parse(svg.step_line([(0.0, 1), (10.0, 3), (20.0, 2)],
                               [(10.0, "scale", "grew to 3"), (20.0, "fault", "lost <w2> & went on")], label="w"))
    path = next(p for p in root.iter(f"{NS}path") if p.get("class") == "world")
    assert path.get("d").count("L") == 4   # two steps, each across then up or down
    lines = [x for x in root.iter(f"{NS}line") if (x.get("class") or "").startswith("mark")]
    assert [x.get("class") for x in lines] == ["mark scale", "mark fault"]
    assert lines[1].find(f"{NS}title").text == "fault: lost <w2> & went on"   # escaped, read back whole
    labels = {t.text for t in root.iter(f"{NS}text")}
    assert {"0", "1", "2", "3"} <= labels


def test_step_line_without_points_says_so():
    root = parse(svg.step_line([], [], label="w"))
    assert "no world size yet" in {t.text for t in root.iter(f"{NS}text")}


def test_hbars_scale_to_the_largest_and_escape_names():
    root = parse(svg.hbars([("alice", 4.0), ("<bob>", 1.0)], label="per user", unit="device-h"))
    a, b = rects(root, "bar")
    assert abs(float(a.get("width")) - 4 * float(b.get("width"))) < 0.5
    assert "<bob>" in {t.text for t in root.iter(f"{NS}text")}
    empty = parse(svg.hbars([], label="per user", unit="device-h"))
    assert "nothing in this range" in {t.text for t in empty.iter(f"{NS}text")}
