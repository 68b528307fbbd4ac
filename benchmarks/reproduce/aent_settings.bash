# AEnt's published settings (Shen, arXiv 2509.03493; the authors' run_aent_math.sh and run_aent_openr1.sh), sourced by
# every reproduction script that runs grpo_aent.py, so that the reference's warm-up is translated in one place: the
# reference first steps the coefficient when global_steps >= W, counted from 1 (coef_0 in steps 1 to W); grpo_aent.py
# first steps it after step --entropy-coef-warmup + 1 (coef_0 in steps 1 to warmup + 1): W is warmup W - 1.
aent_warmup() { echo $(($1 - 1)); }
# the MATH run (Qwen2.5-Math-1.5B): the scripts with no AEnt setting of their own use it (the entropy box is
# model-specific: check entropy/clamped of the first steps)
AENT_MATH="--clamp-p 0.33 --entropy-coef 0.002 --entropy-low 0.15 --entropy-high 0.24 --entropy-coef-lr 0.002
           --entropy-coef-warmup $(aent_warmup 30) --entropy-coef-min 6e-4 --entropy-coef-max 9e-3"
# the OpenR1 run (R1-Distill-Qwen-1.5B): warm-up one epoch, 156 steps
AENT_OPENR1="--clamp-p 0.25 --entropy-coef 3e-4 --entropy-low 0.35 --entropy-high 0.62 --entropy-coef-lr 1e-4
             --entropy-coef-warmup $(aent_warmup 156) --entropy-coef-min 4e-5 --entropy-coef-max 1e-3"
