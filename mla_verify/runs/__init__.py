"""The run, whatever starts it (`check`, `gate`, a part, a shard): what it is (`plan`), what it
judges (`units`), how it is executed (`driver`), who hears of each case (`sink`), its slots and
child processes (`parts`), its directory (`rundir`, `merge`), Ctrl-C (`interrupt`) and what it
leaves (`outcome`)."""
