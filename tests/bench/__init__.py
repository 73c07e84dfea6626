"""Tests of the scripts in bench/: the GPU script's CPU dry run (collected early, so its minute runs beside other work)."""
