"""Model building blocks and families; everything here is a pure function of (params, arrays)."""
