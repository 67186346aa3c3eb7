"""The kernels of the selected compile tests (test_triton_compile.py) compile in child processes from the first
attention test on, instead of alone when their module comes, and those tests run last: compilation is
single-threaded, as most tests are, so that the children run on the cores the tests leave idle, for as long as the
rest of the session lasts (the sample takes longer than the attention tests before its module). Beside the tests of
other modules the sample compiles in one child fewer than the cores: with one per core, the children and the tests
shared the cores three ways on a 2-core machine until the sample was done, and a core then stood idle for the rest of
the session. When the sample's tests come, the test process waits for the compilation, and children start on every
core for the cases not yet taken (``triton_aot.Compilation``'s queue)."""

import importlib.util

import pytest
from triton_aot import Compilation, case_id, usable_cores

SAMPLE_TEST = "test_kernel_compiles_and_fits"


def is_test(item, test_name):
    """Whether ``item`` is a case of the test function ``test_name``."""
    return getattr(item, "originalname", None) == test_name


def selected_cases(session, test_name):
    """The cases of the selected tests of that name (all of them, or fewer with -k), each once."""
    cases = {}
    for item in session.items:
        if is_test(item, test_name):
            case = item.callspec.params["case"]
            cases[case_id(case)] = case
    return list(cases.values())


def pytest_collection_modifyitems(items):
    compiling = [item for item in items if is_test(item, SAMPLE_TEST)]
    if compiling:
        items[:] = [item for item in items if not is_test(item, SAMPLE_TEST)] + compiling


def start_compiling(request, tmp_path_factory, test_name, processes=None):
    cases = selected_cases(request.session, test_name)
    if not cases or importlib.util.find_spec("triton") is None:  # the compile tests skip without Triton
        return None
    return Compilation(cases, tmp_path_factory.mktemp("triton-cache"), processes)


@pytest.fixture(scope="session", autouse=True)
def sample_compilation(request, tmp_path_factory):
    items = request.session.items
    compile_modules = {item.path for item in items if is_test(item, SAMPLE_TEST)}
    beside_others = any(item.path not in compile_modules for item in items)  # its module's other tests take no time
    processes = max(1, usable_cores() - 1) if beside_others else None
    compilation = start_compiling(request, tmp_path_factory, SAMPLE_TEST, processes)
    yield compilation
    if compilation is not None:
        compilation.close()  # the session ended before its tests (-x, a keyboard interrupt)


@pytest.fixture(scope="module")
def full_compilation(request, tmp_path_factory):
    return start_compiling(request, tmp_path_factory, "test_kernel_compiles_and_fits_everywhere")
