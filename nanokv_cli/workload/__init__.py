"""What a run is given: prompt files and Mooncake traces as requests."""
