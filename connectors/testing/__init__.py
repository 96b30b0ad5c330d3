"""Dev and test backends: the scripted model server, the example tool server, hostile inputs."""
