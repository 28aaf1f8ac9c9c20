"""Tests of the SGLang stand-in (servers/sim). A package, so its module names cannot clash with other test folders'."""
