"""Test-wide settings: float32 matmuls at full precision so tolerances mean what they say."""
import jax

jax.config.update("jax_default_matmul_precision", "highest")
