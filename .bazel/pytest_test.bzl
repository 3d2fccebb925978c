"""Bazel tests for pytest files: pytest_file (the targets of one file), pytest_test (one target)."""

# What `bash experiments/run.sh test` sets: 8 simulated CPU devices (tests/conftest.py adds the same
# device count when it is missing, and the flag deviceless GPU compiles need).
TEST_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
}

def pytest_test(name, src, marks, split = False, srcs = [], **kwargs):
    """A py_test running pytest on `src` through //.bazel:pytest_main.py.

    Args:
      name: target name.
      src: the test file.
      marks: a pytest -m expression selecting which of its tests run.
      split: whether another target runs the tests `marks` leaves out (else leaving out one fails).
      srcs: other test files that `src` imports.
      **kwargs: py_test attributes (deps, data, size, tags, ...).
    """

    # Bazel splits args as a shell would; the quotes keep the expression one argument.
    args = ["$(rootpath %s)" % src, "-m", "'%s'" % marks] + (["--split"] if split else [])
    native.py_test(
        name = name,
        srcs = ["//.bazel:pytest_main.py", src] + srcs,
        main = "//.bazel:pytest_main.py",
        args = args,
        env = TEST_ENV,
        python_version = "PY3",
        **kwargs
    )

def pytest_file(src, slow = None, heavy = False, tags = [], **kwargs):
    """The test targets of one pytest file, named after it (tests/test_x.py -> //tests:test_x).

    Args:
      src: the test file.
      slow: which of its tests are marked `slow`: None (none), "all" (one target, tagged slow) or "split"
        (<name> runs the others, <name>_slow, tagged slow, the slow ones). A target fails if the file's
        marks no longer match (.bazel/pytest_main.py).
      heavy: whether the tests not marked slow take minutes (tagged heavy, left out of --config=fast).
      tags: tags of every target.
      **kwargs: passed to pytest_test (srcs, deps, data, ...).
    """
    name = src[:-len(".py")]

    # Bazel's sizes set the timeouts (.bazelrc): medium 5 minutes, enormous 2 hours.
    size = "enormous" if heavy else "medium"
    tags = tags + (["heavy"] if heavy else [])
    if slow == None:
        pytest_test(name = name, src = src, marks = "not slow", size = size, tags = tags, **kwargs)
    elif slow == "all":
        pytest_test(name = name, src = src, marks = "slow", size = "enormous", tags = tags + ["slow"], **kwargs)
    elif slow == "split":
        pytest_test(name = name, src = src, marks = "not slow", split = True, size = size, tags = tags, **kwargs)
        pytest_test(
            name = name + "_slow",
            src = src,
            marks = "slow",
            split = True,
            size = "enormous",
            tags = tags + ["slow"],
            **kwargs
        )
    else:
        fail("pytest_file(%s): slow must be None, 'all' or 'split', not %r" % (src, slow))
