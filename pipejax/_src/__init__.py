"""Private implementation of pipejax. Import public names from :mod:`pipejax`."""
