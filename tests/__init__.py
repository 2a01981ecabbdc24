"""The test suite, by area: engine/, modules/ (one course module's source each), cli/, course/, and support/."""
