"""The test suite, by area: engine/, modules/ (the course modules' sources), cli/, course/ and support/."""
