"""Schedule pictures (`Schedule.plot`, `render`): what they draw is exactly the table."""

import matplotlib
import numpy as np
import pytest

import pipejax as pj
from pipejax._src import timeline

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
    if isinstance(table, pj.Schedule):
        parts = {"F": table.table}
    else:
        parts = {"F": table.forward, "B": table.backward}
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
