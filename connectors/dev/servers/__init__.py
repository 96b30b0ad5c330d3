"""Dev and test backends: the scripted model server, the example tool server, hostile inputs,
and simulated run logs (the workload) with a writer that puts them on the topics."""
