"""tools/kernels/triton_aot.py's queue of cases: the compile children share it, each case taken by one of them."""

import json

from triton_aot import take_cases


def test_children_taking_from_one_queue_take_every_case_once(tmp_path):
    (tmp_path / "taken").mkdir()
    cases = [dict(index=index) for index in range(7)]
    for case in cases:
        (tmp_path / f"{case['index']:05d}.json").write_text(json.dumps(case))
    # Each child lists the queue at its first case, so that later ones find cases gone that they listed.
    children = [(take_cases(tmp_path), []) for _ in range(3)]
    running = list(children)
    while running:  # in turns, as children that compile at different speeds would
        for child in list(running):
            case = next(child[0], None)
            if case is None:
                running.remove(child)
            else:
                child[1].append(case["index"])
    taken = [indices for _, indices in children]
    assert sorted(sum(taken, [])) == list(range(7))
    assert all(taken)
    assert not list(tmp_path.glob("*.json"))
