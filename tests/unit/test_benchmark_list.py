"""Every benchmark is on ``make bench``'s list, which is where CI finds what to run in its
smoke mode (tests/acceptance/test_benchmarks.py): a benchmark left off it would rot
unseen."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks import REPO, bench_lines, bench_modules


def test_every_benchmark_is_on_the_make_bench_list_and_takes_the_smoke_flag() -> None:
    listed = {command[1] for command in bench_lines()}
    assert bench_modules() == listed
    for module in listed:
        source = (REPO / Path(*module.split("."))).with_suffix(".py").read_text()
        assert "add_smoke_flag(parser)" in source, f"{module} has no --smoke"


def test_the_bench_recipe_is_read_line_by_line(tmp_path: Path) -> None:
    makefile = tmp_path / "Makefile"
    makefile.write_text(
        "bench: $(STAMP)\n"
        "\t$(BIN)/python -m bench.one $(BENCH_ARGS)\n"
        "\t$(BIN)/python -m bench.two --what x $(BENCH_ARGS)\n"
        "\nother:\n\t$(BIN)/python -m bench.three $(BENCH_ARGS)\n"
    )
    assert bench_lines(makefile) == [["-m", "bench.one"], ["-m", "bench.two", "--what", "x"]]
    makefile.write_text("bench: $(STAMP)\n\t$(BIN)/python -m bench.one --rounds 3\n")
    with pytest.raises(ValueError, match="BENCH_ARGS"):
        bench_lines(makefile)


def test_a_module_with_a_main_guard_is_a_benchmark_unless_a_helper(tmp_path: Path) -> None:
    folder = tmp_path / "bench"
    folder.mkdir()
    main_guard = 'if __name__ == "__main__":\n    main()\n'
    (folder / "fast.py").write_text("def main():\n    pass\n\n" + main_guard)
    (folder / "harness.py").write_text("def until():\n    pass\n")
    (folder / "slow_provider.py").write_text(main_guard)
    assert bench_modules(folder) == {"bench.fast"}
