"""The CI guard in tests/conftest.py: under GHOSTGPU_REQUIRE_INTEGRATION=1 (.ci/run) a skip anywhere
(unit tests too) and at any time (a fixture, the test, a skipif mark, module collection) is a failure,
except the allowlisted reasons; without the variable skips stay skips. Each case runs a small test
file in a pytester session wired with the real hooks."""

from __future__ import annotations

import pytest

from tests.conftest import ALLOWED_SKIPS, STRICT_ENV, allowed_skip

pytest_plugins = ["pytester"]

CONFTEST = """
from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401
"""

CASES = """
import pytest

@pytest.fixture
def needs_a_tool():
    pytest.skip("sometool is missing: apt-get install sometool")

def test_skips_in_the_test():
    pytest.skip("promtool missing: apt-get install prometheus")

def test_skips_in_a_fixture(needs_a_tool):
    pass

@pytest.mark.skipif(True, reason="strace not installed")
def test_skipif_mark():
    pass

@pytest.mark.skip(reason="not today")
def test_skip_mark():
    pass

def test_allowed_reason():
    pytest.skip("a real NVML (libnvidia-ml.so.1) is installed here, so its absence cannot be simulated")

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_expected_failure():
    assert False

def test_passes():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_cases=CASES)
    return pytester


def test_without_the_variable_skips_stay_skips(suite: pytest.Pytester,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRICT_ENV, raising=False)
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=5, xfailed=1)


def test_under_ci_every_skip_fails_but_the_allowed_ones(suite: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    result = suite.runpytest("-p", "no:cacheprovider", "-rA")
    # test_skips_in_a_fixture and the two marks fail in setup: pytest counts those as errors.
    result.assert_outcomes(passed=1, skipped=1, failed=1, errors=3, xfailed=1)
    for line in (f"*skipped in call while {STRICT_ENV}=1*promtool missing: apt-get install prometheus",
                 f"*skipped in setup while {STRICT_ENV}=1*sometool is missing: apt-get install sometool",
                 f"*skipped in setup while {STRICT_ENV}=1*strace not installed",
                 f"*skipped in setup while {STRICT_ENV}=1*not today"):
        result.stdout.fnmatch_lines([line])
    result.stdout.fnmatch_lines(["SKIPPED*a real NVML (libnvidia-ml.so.1) is installed here*"])
    assert result.ret != 0


@pytest.mark.parametrize("module", [
    "import pytest\ndep = pytest.importorskip('ghostgpu_no_such_module')\n\ndef test_x():\n    pass\n",
    "import pytest\npytest.skip('no cgroup2 here', allow_module_level=True)\n\ndef test_x():\n    pass\n",
], ids=["importorskip", "module-level-skip"])
def test_under_ci_a_skip_at_collection_fails(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                            module: str) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_collect=module)
    monkeypatch.delenv(STRICT_ENV, raising=False)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=1)
    monkeypatch.setenv(STRICT_ENV, "1")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*skipped at collection while {STRICT_ENV}=1*"])
    assert result.ret != 0


@pytest.mark.parametrize("reason", [
    # The exact texts of the skips the allowlist is for (tests/integration/test_tracer.py, test_nvml_fake.py).
    "/dev/nvidia200 exists on this host; refusing to touch it",
    "a real NVML (libnvidia-ml.so.1) is installed here, so its absence cannot be simulated",
])
def test_the_allowlist_matches_the_real_gpu_skips(reason: str) -> None:
    assert allowed_skip(reason)


@pytest.mark.parametrize("reason", [
    "needs root (BPF, mknod, namespaces); run as root or via scripts/bootstrap.sh test",
    "/usr/bin/promtool missing: apt-get install prometheus (scripts/bootstrap.sh install)",
    "bcc is not installed (apt-get install python3-bpfcc; scripts/bootstrap.sh install)",
    "no cgroup2 hierarchy on this host (pure cgroup v1)",
    "a real NVML (libnvidia-ml.so.1) is installed here, so its absence cannot be simulated; and more",
])
def test_the_allowlist_does_not_cover_missing_components(reason: str) -> None:
    assert not allowed_skip(reason)


def test_every_allowlisted_reason_says_why() -> None:
    assert ALLOWED_SKIPS and all(why.strip() for why in ALLOWED_SKIPS.values())
