"""experiment_binary: a py_binary for one absl entry point of experiments/, run as `python -m <module>`.

The binary's main is generated from experiment_main.py.tpl: under `bazel run` it first returns to the
directory the command was started in (Bazel starts binaries inside their runfiles tree), so relative
--config and --workdir paths mean what they mean for `python -m experiments.<name>` in a checkout."""

def _experiment_main_impl(ctx):
    ctx.actions.expand_template(
        template = ctx.file._template,
        output = ctx.outputs.out,
        substitutions = {
            "%{module}": ctx.attr.module,
            "%{simulate_cpu_devices}": str(ctx.attr.simulate_cpu_devices),
            "%{target}": str(ctx.label.relative(ctx.attr.binary)),
        },
    )

_experiment_main = rule(
    implementation = _experiment_main_impl,
    attrs = {
        "binary": attr.string(mandatory = True, doc = "name of the py_binary this is the main of"),
        "module": attr.string(mandatory = True),
        "out": attr.output(mandatory = True),
        "simulate_cpu_devices": attr.bool(),
        "_template": attr.label(default = "//.bazel:experiment_main.py.tpl", allow_single_file = True),
    },
)

def experiment_binary(name, module, srcs, simulate_cpu_devices = False, **kwargs):
    """A py_binary `name` running `python -m module`.

    Args:
      name: target name.
      module: the entry point's module, e.g. experiments.train.
      srcs: its file, e.g. train.py.
      simulate_cpu_devices: simulate MESHMOE_CPU_DEVICES (default 8) CPU devices, as
        `bash experiments/run.sh train` does (XLA ignores it on GPUs).
      **kwargs: py_binary attributes (deps, data, ...).
    """
    main = name + "_main.py"
    _experiment_main(
        name = name + "_main",
        binary = name,
        module = module,
        out = main,
        simulate_cpu_devices = simulate_cpu_devices,
    )
    native.py_binary(name = name, srcs = [main] + srcs, main = main, python_version = "PY3", **kwargs)
