"""Operator tools that are not services (status, report, eval, export, launcher helpers).

They may import ``common/`` and one process package's public functions, never
the other way round (DESIGN.md section 2).
"""
