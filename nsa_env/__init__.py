"""Environment tooling for nsa, installed with it (the `nsa-env` command): the environment report
(report.py), lock drift (drift.py; the lock parser, lockfile.py, is the one ci/ uses too), the doctor
(doctor/), the build toolchain's facts (toolchain.py), the upstream facts of the configuration matrix
(upstream.py, upstream.json) and the GPU architectures of CUDA binaries (cuda_archs.py).

It reads nsa (which backends can run here); nsa never imports it. Importing this package imports
nothing heavy: ci/ imports nsa_env.lockfile in an interpreter without torch.
"""
