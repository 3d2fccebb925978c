"""meshmoe_library: a Python library whose files are importable under their `meshmoe.*` name.

The source folders are not named after their import paths (src/ is `meshmoe`, models/ is `meshmoe.models`;
pyproject.toml maps them), so this rule links each file to its import path in the runfiles tree of every
binary and test that depends on it: models/moe.py -> <runfiles>/<workspace>/meshmoe/models/moe.py.
Links, not copies; the four packages' links meet in one `meshmoe/` directory, which one Python package
needs (a package cannot be split over two sys.path entries)."""

def _meshmoe_library_impl(ctx):
    target_dir = ctx.attr.import_path.replace(".", "/")
    links = {}
    for f in ctx.files.srcs + ctx.files.data:
        if f.owner.package != ctx.label.package or f.owner.workspace_name != ctx.label.workspace_name:
            fail("%s: %s is not in this package; list it in its own package's library" % (ctx.label, f.owner))
        links["%s/%s" % (target_dir, f.owner.name)] = f

    # Runfiles `symlinks` live under the main workspace's directory, which is on sys.path (`imports`).
    runfiles = ctx.runfiles(symlinks = links)
    for dep in ctx.attr.deps:
        runfiles = runfiles.merge(dep[DefaultInfo].default_runfiles)
    deps = [dep[PyInfo] for dep in ctx.attr.deps]
    return [
        DefaultInfo(files = depset(ctx.files.srcs), runfiles = runfiles),
        PyInfo(
            transitive_sources = depset(ctx.files.srcs, transitive = [d.transitive_sources for d in deps]),
            imports = depset([ctx.workspace_name], transitive = [d.imports for d in deps]),
        ),
    ]

meshmoe_library = rule(
    implementation = _meshmoe_library_impl,
    doc = "Python sources of one package folder, placed at `import_path` (e.g. meshmoe.models) at run time.",
    attrs = {
        "srcs": attr.label_list(allow_files = [".py"], doc = "the package's .py files, subfolders included"),
        "data": attr.label_list(allow_files = True, doc = "package data, placed like the sources"),
        "deps": attr.label_list(providers = [PyInfo], doc = "the libraries these sources import"),
        "import_path": attr.string(mandatory = True, doc = "dotted package name of this folder"),
    },
)
