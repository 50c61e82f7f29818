"""Does the method pay? One elastic run against making each size separately (``compare``)."""
