"""Operator tools that are not services (status, report, eval, export, launcher helpers).

They may import ``common/`` and the process packages' public functions, never
the other way round (docs/architecture.md, "Packages").
"""
