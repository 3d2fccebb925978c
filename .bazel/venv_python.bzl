"""The Python toolchain: the project's own virtual environment, found when Bazel loads the workspace.

The venv's path differs per machine, so a repository rule looks it up (MESHMOE_VENV, default
<workspace>/.venv-test, the environment `bash experiments/run.sh test` creates) and writes a py_runtime
with that interpreter. Third-party packages (jax, flax, pytest, ...) come from its site-packages."""

_MIN_VERSION = (3, 12)

def _venv_python_impl(rctx):
    workspace = rctx.path(Label("@//:WORKSPACE")).dirname
    venv = rctx.os.environ.get("MESHMOE_VENV", "") or ".venv-test"
    if not venv.startswith("/"):
        venv = "%s/%s" % (workspace, venv)
    python = rctx.path(venv + "/bin/python")
    command = "`bash experiments/run.sh test --collect-only -q`"
    if not python.exists:
        fail("meshmoe: no Python environment at %s; create it with %s, or set MESHMOE_VENV to another venv" % (
            venv, command))
    probe = rctx.execute([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
    version = probe.stdout.strip()
    if probe.return_code != 0 or tuple([int(v) for v in version.split(".")]) < _MIN_VERSION:
        fail("meshmoe: %s is Python %s, meshmoe needs >= %d.%d; recreate the venv with %s" % (
            python, version or "(did not run)", _MIN_VERSION[0], _MIN_VERSION[1], command))
    rctx.template("BUILD", rctx.attr._build_template, {
        "%{interpreter}": str(python),
        "%{version}": version,
    })

venv_python = repository_rule(
    implementation = _venv_python_impl,
    attrs = {"_build_template": attr.label(default = "//.bazel:venv_python.BUILD.tpl")},
    environ = ["MESHMOE_VENV"],
    # Reads the local machine, not the network: re-evaluated when Bazel restarts or MESHMOE_VENV changes.
    local = True,
)
