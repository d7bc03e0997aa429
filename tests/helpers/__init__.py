"""Plain helpers shared by the test folders (no fixtures: those live in the conftest.py files).

Importable as ``helpers.<module>`` because ``pyproject.toml`` puts ``tests/`` on the path
(``pythonpath = ["tests"]``); no test module imports another test module.
"""
