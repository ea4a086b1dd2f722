"""The model room: plain data every floor speaks (a node's Consumer, the cluster's view of it, the
tracer's typed records, trace sessions), every class rule, and how values are checked and shown."""
