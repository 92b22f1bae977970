"""What a configuration implies for ``cellpath plan``: the paper's configuration (``paper``), the
workload counted from the params or the data (``workload``), the whole plan priced with the cost
model (``build``) and its text table (``render``)."""
