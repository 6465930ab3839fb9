"""How the nox sessions install and run: cell installs, the README Quick start as CI runs it, the GPU suites."""
