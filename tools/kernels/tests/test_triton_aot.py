"""tools/kernels/triton_aot.py's queue of cases: the compile children share it, each case taken by one of them."""

from triton_aot import queue_cases, take_cases


def test_children_taking_from_one_queue_take_every_case_once(tmp_path):
    queue = queue_cases(tmp_path / "queue", [dict(index=index) for index in range(7)])
    # Each child lists the queue at its first case, so that later ones find cases gone that they listed.
    children = [(take_cases(queue), []) for _ in range(3)]
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
    assert not list(queue.glob("*.json"))
