"""mpistrat info's host rows: which ranks each host holds, in the order of its first rank."""

from mpistrat.cli.info import _rank_list, render_info
from mpistrat.info import hosts_of


def test_hosts_in_order_of_their_first_rank_with_round_robin_placement():
    assert hosts_of(["b", "a", "b", "a"], [0, 1, 0, 1]) == [
        {"host": "b", "ranks": [0, 2], "nodes": [0]},
        {"host": "a", "ranks": [1, 3], "nodes": [1]},
    ]


def test_virtual_nodes_cut_one_host_into_several_groups():
    assert hosts_of(["h"] * 4, [0, 0, 1, 1]) == [{"host": "h", "ranks": [0, 1, 2, 3],
                                                 "nodes": [0, 1]}]


def test_rank_lists_collapse_runs():
    assert _rank_list([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert _rank_list([3]) == "3"


def test_render_shows_one_row_per_host():
    data = {
        "mpistrat": "0", "python": "3", "mpi4py": "4",
        "mpi": {"vendor": "MPICH 5", "standard": "5.0", "thread_level": "multiple",
                "library_version": "MPICH", "library_path": None},
        "launcher": {"name": None, "size": None}, "world_size": 4, "nodes": 2,
        "ranks_per_node": [3, 1], "virtual_ranks_per_node": None,
        "hosts": hosts_of(["node1"] * 3 + ["node2"], [0, 0, 0, 1]),
        "gpus_per_rank": 1, "slurm": None, "ranks": [], "notes": [], "warnings": [],
    }
    text = render_info(data)
    assert "hosts        2 host(s)\n  node1      ranks 0-2  (node group 0)\n" \
           "  node2      ranks 3  (node group 1)" in text
