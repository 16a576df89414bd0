"""The back end: rank programs become per-rank torch programs, a launcher and a
manifest (`codegen`), the manifest's content being the torch-free `plan`. Nothing
here imports torch: the generated programs do, through `ppdsl.runtime`."""
