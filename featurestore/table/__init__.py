"""Table mechanics: the store's Lance tables, their names, leases, commits, versions and health.

Owns everything that touches a table on disk or in a bucket. Bottom to top: ``names`` (table and
tag names), ``objects`` (store URIs, storage options, small files and listings on local disk or an
object store), ``base`` (paths, opening a table at a version, the head record that detects a
rollback, whole-version reads), ``lease`` (one writer per table, pins), ``integrity`` (CRC
sidecars, written at commit and checked before training reads), ``fragments`` (write fragments
anywhere, commit them atomically with lineage), ``versions`` (list, tag, diff, restore),
``maintenance`` (verify, compact, gc), and ``store``, the facade the stages and the rooms above
use. No module here imports ``store``, so the room has no import loop.
"""
