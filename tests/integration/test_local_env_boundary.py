"""No tenant value becomes the environment of a host process: a library named in a
dispatch's (or an exec's) LD_PRELOAD is never loaded by bubblewrap, setpriv, nsenter or
``timeout``, which run on the host (some as root); the work's variables reach the work
inside the sandbox. Real bubblewrap and a real library built by the test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from corral.providers.local.provider import LocalProvider
from tests.conftest import SpecFactory, require
from tests.integration.test_local_provider import output_of, wait_until_final

# The constructor of the planted library: one line per process that loads it, naming it.
PLANTED_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    char name[64] = {0};
    FILE *comm = fopen("/proc/self/comm", "r");
    if (comm) { if (!fgets(name, sizeof name, comm)) name[0] = 0; fclose(comm); }
    name[strcspn(name, "\n")] = 0;
    FILE *out = fopen(MARKS, "a");
    if (out) { fprintf(out, "%s uid=%d\n", name, (int)geteuid()); fclose(out); }
}
"""


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """A shared library that records who loads it, and the file it records in. Both in a
    directory only the host's root reaches: a line there is a host process's."""
    require(shutil.which("gcc") is not None, "gcc")
    folder = tmp_path / "planted"
    folder.mkdir(mode=0o700)
    source, library, marks = folder / "planted.c", folder / "planted.so", folder / "marks"
    source.write_text(PLANTED_C)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f'-DMARKS="{marks}"', "-o", str(library), str(source)],
        check=True,
    )
    return library, marks


LOADER_VARIABLES = ("LD_PRELOAD", "LD_AUDIT")


@pytest.mark.parametrize("variable", LOADER_VARIABLES)
def test_a_dispatch_env_library_is_never_loaded_by_a_host_process(
    require_bwrap: str,
    sandbox_root: Path,
    make_spec: SpecFactory,
    planted: tuple[Path, Path],
    variable: str,
) -> None:
    library, marks = planted
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    command = ["sh", "-c", f'echo "work sees ${variable}"']
    spec = make_spec(env={variable: str(library)}, provider_options={"command": command})
    handle = provider.provision(spec)
    wait_until_final(provider, handle)
    output = output_of(provider, handle)
    provider.terminate(handle)
    assert not marks.exists(), marks.read_text()
    # The work itself got the variable (its own process may use it, inside the sandbox).
    assert f"work sees {library}" in output, output


def test_an_exec_env_library_is_never_loaded_by_a_host_process(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, planted: tuple[Path, Path]
) -> None:
    library, marks = planted
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "60"]}))
    try:
        result = provider.exec_command(
            handle,
            'echo "exec sees $LD_PRELOAD $GREETING"',
            env={"LD_PRELOAD": str(library), "GREETING": "hi"},
        )
    finally:
        provider.terminate(handle)
    assert not marks.exists(), marks.read_text()
    assert f"exec sees {library} hi" in result.stdout, result
