"""The commands (`python -m tr_engine.chat`, `.generate`, `.serve`): their flags, their one-line errors and exit
statuses."""
