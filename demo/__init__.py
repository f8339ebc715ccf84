"""The built-in demo's assets: the digits data, the tiny Stable Diffusion bases (`make data`, `make tiny-sd`)."""
