"""The names @bazel_tools loads from @rules_java//java:defs.bzl, forwarded to Bazel's native rules."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
