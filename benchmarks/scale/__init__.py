"""Schedule build time at scale (pp up to 64): this package's lowering against torch's."""
