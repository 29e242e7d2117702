"""Schedule pictures (`Schedule.plot`, `render`): what they draw is exactly the table."""

import matplotlib
import numpy as np
import pytest

import pipejax as pj
from pipejax._src.schedules import tables as schedule
from pipejax._src.schedules import timeline

matplotlib.use("Agg")

TABLES = {
    "gpipe": pj.gpipe_schedule(4, 6),
    "circular": pj.circular_schedule(2, 4, 2),
    "1f1b": pj.one_f_one_b_schedule(4, 6),
    "zb-h1": pj.zb_h1_schedule(3, 5),
    "interleaved-1f1b": pj.interleaved_one_f_one_b_schedule(2, 4, 2),
}


def working_slots(table) -> list[tuple[str, int, int, int]]:
    """(kind, tick, device, micro-batch) of every slot that works, read from the table itself."""
    parts = {"F": table.table}
    if table.trains:
        parts["B"] = table.backward
        if table.weight is not None:
            parts["W"] = table.weight
    return sorted(
        (kind, int(t), int(d), int(a[t, d])) for kind, a in parts.items() for t, d in np.argwhere(a >= 0)
    )


@pytest.mark.parametrize("name", TABLES)
def test_render_shows_every_slot_of_the_table(name):
    table = TABLES[name]
    text = table.render()
    lines = text.splitlines()
    assert len(lines) == table.num_devices
    k = len(timeline.kinds(table))
    seen = []
    for d, line in enumerate(lines):
        cells = line.split("|")[1:-1]
        assert len(cells) == table.num_ticks
        for t, cell in enumerate(cells):
            parts = cell.split()
            assert len(parts) == k
            for part in parts:
                if part != ".":
                    micro = int(part[1:].split("s")[0])
                    seen.append((part[0], t, d, micro))
    assert sorted(seen) == working_slots(table)


@pytest.mark.parametrize("name", TABLES)
def test_plot_draws_one_coloured_cell_per_working_slot(name):
    import matplotlib.pyplot as plt

    table = TABLES[name]
    ax = table.plot(notes={0: "note for device 0"})
    try:
        coloured = [p for p in ax.patches if p.get_facecolor()[:3] != (1.0, 1.0, 1.0)]
        blank = [p for p in ax.patches if p.get_facecolor()[:3] == (1.0, 1.0, 1.0)]
        slots = working_slots(table)
        k = len(timeline.kinds(table))
        assert len(coloured) == len(slots)
        assert len(coloured) + len(blank) == table.num_ticks * table.num_devices * k
        # a cell's position is its tick (and slot within the tick) and its device (0 on top)
        xs = sorted((round(p.get_x() * k), table.num_devices - 1 - round(p.get_y())) for p in coloured)
        names = timeline.kinds(table)
        assert xs == sorted((t * k + names.index(kind), d) for kind, t, d, _ in slots)
        assert "note for device 0" in [t.get_text() for t in ax.texts]
    finally:
        plt.close(ax.figure)


def test_inputs_held_matches_the_tables():
    assert timeline.inputs_held(pj.gpipe_schedule(4, 8)).tolist() == [11] * 4
    one = pj.one_f_one_b_schedule(4, 64)
    assert timeline.inputs_held(one).tolist() == [7, 5, 3, 1]  # 2(n - d) - 1, flat in m
    assert timeline.inputs_held(one).max() == one.stash_slots()


def test_a_non_table_is_refused():
    with pytest.raises(TypeError, match=r"`schedule` must be a pipejax schedule table.*got list"):
        timeline.render([[0, 1]])


# --- render and inputs_held against naive references ---------------------------------------------


def _naive_render(schedule) -> str:
    """The first, cell-by-cell version of `render`, kept as its specification."""
    micro, stage, kind = timeline.slots(schedule)
    names = timeline.kinds(schedule)

    def label(t, d, j):
        return timeline._label(names[kind[t, d, j]], micro[t, d, j], stage[t, d, j], schedule.repeats)

    width = max([len(label(t, d, j)) for t, d, j in np.ndindex(micro.shape) if micro[t, d, j] >= 0] or [1])
    lines = []
    for d in range(schedule.num_devices):
        cells = []
        for t in range(schedule.num_ticks):
            parts = [
                (label(t, d, j) if micro[t, d, j] >= 0 else ".").ljust(width) for j in range(micro.shape[2])
            ]
            cells.append(" ".join(parts))
        lines.append(f"device {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _random_tables(seed=0, count=8):
    """Random small tables of every kind, forward and training (fixed seed; n, m, v drawn)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n, m, v = (int(a) for a in (rng.integers(1, 6), rng.integers(1, 14), rng.integers(2, 4)))
        out += [pj.gpipe_schedule(n, m), pj.circular_schedule(n, m, v), pj.sequential_schedule(n, m)]
        out += [pj.one_f_one_b_schedule(n, m), pj.zb_h1_schedule(n, m)]
        out.append(pj.interleaved_one_f_one_b_schedule(n, n * (1 + m // n), v))
        out += [schedule.one_device(n, m), schedule.sequential_training(n, m)]
    return out


def test_render_equals_the_naive_reference():
    for table in _random_tables():
        assert table.render() == _naive_render(table)


def test_inputs_held_scales_to_long_tables():
    """m = 200,000 micro-batches: the held count of a scan per input took minutes (quadratic)."""
    one = pj.one_f_one_b_schedule(4, 200_000)
    assert pj.timeline_inputs_held(one).tolist() == [7, 5, 3, 1]
    assert pj.timeline_inputs_held(pj.zb_h1_schedule(4, 200_000)).tolist() == [7, 6, 5, 4]


# --- plot's arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"ax": "left"},
            TypeError,
            r"`ax` of Schedule.plot must be a matplotlib Axes .* but got str 'left'",
        ),
        (
            {"ax": [1, 2]},
            TypeError,
            r"`ax` of Schedule.plot .* got list \[1, 2\]\. Pass e\.g\. `fig, ax = plt",
        ),
        ({"title": 3}, TypeError, r"`title` of Schedule.plot must be a string, or None .* got int 3"),
        (
            {"labels": "yes"},
            TypeError,
            r"`labels` of Schedule.plot must be True, False, or None .* got str",
        ),
        ({"labels": 1}, TypeError, r"`labels` of Schedule.plot .* but got int 1"),
        ({"notes": ["a"]}, TypeError, r"`notes` of Schedule.plot must be a dict from device to text"),
        ({"notes": {4: "x"}}, ValueError, r"note for device 4, but the table has the devices 0 \.\. 3; key"),
        ({"notes": {-1: "x"}}, ValueError, r"note for device -1, but the table has the devices 0 \.\. 3"),
        ({"notes": {"0": "x"}}, ValueError, r"note for device '0', but the table has the devices 0 \.\. 3"),
        ({"notes": {1.0: "x"}}, ValueError, r"note for device 1\.0, but the table has the devices 0 \.\. 3"),
        ({"notes": {True: "x"}}, ValueError, r"note for device True, but the table has the devices 0 \.\. 3"),
        (
            {"notes": {0: 1.5}},
            TypeError,
            r"must map each device to a string, but the note for device 0 is float 1\.5",
        ),
    ],
)
def test_plot_refuses_bad_arguments(kwargs, error, match):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    with pytest.raises(error, match=match):
        pj.one_f_one_b_schedule(4, 6).plot(**kwargs)
    assert plt.get_fignums() == before  # refused before a figure is made


def test_plot_names_the_devices_of_a_forward_table():
    with pytest.raises(
        ValueError,
        match=r"`notes` of Schedule.plot has a note for device 2, but the table has the devices 0 \.\. 1",
    ):
        pj.gpipe_schedule(2, 3).plot(notes={2: "x"})
    with pytest.raises(ValueError, match=r"note for device 1, but the table has device 0;"):
        pj.one_f_one_b_schedule(1, 3).plot(notes={1: "x"})


def test_plot_takes_numpy_devices_and_an_axes():
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(1, 2)
    try:
        ax = pj.one_f_one_b_schedule(2, 3).plot(
            ax=axs[1], notes={np.int64(1): "B"}, labels=np.bool_(True), title="t"
        )
        assert ax is axs[1] and "B" in [t.get_text() for t in ax.texts] and ax.get_title() == "t"
    finally:
        plt.close(fig)
