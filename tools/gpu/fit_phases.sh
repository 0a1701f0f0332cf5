# Sourced by the maps' GPU scripts (maps.sh, maps_device.sh): fit_phases times a `fit` of "$work/sample" from an
# empty prepared-study cache for each "name:tree" of the array trees, and writes each fit's phases
# (train_log.json) to the summary through say. Expects N, PY, work and say to be set by the script.
fit_phases() {
    local entry name tree start wall
    for entry in "${trees[@]}"; do
        [ "${MAPS_FIT:-1}" = 0 ] && break
        name=${entry%%:*}; tree=${entry#*:}
        PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" $N cache --clear prepared > /dev/null
        start=$(date +%s%N)
        PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" $N fit "$work/sample" --out "$work/run-$name" > "$work/logs/fit-$name.txt" 2>&1 \
            || { say "fit ($name) failed:"; tail -n 5 "$work/logs/fit-$name.txt" | tee -a "$summary"; continue; }
        wall=$(( ($(date +%s%N) - start) / 1000000 ))
        say ""
        say "== $name, fit of the sample, empty prepared cache: ${wall} ms wall =="
        $PY - "$work/run-$name/train_log.json" <<'PYEOF' | tee -a "$summary"
import json, sys
log = json.load(open(sys.argv[1]))
for phase in log.get("phases") or []:
    print(f"  {phase.get('name')}: {phase.get('seconds', float('nan')):.2f} s")
PYEOF
        cp "$work/run-$name/train_log.json" "$work/json/fit-$name-train_log.json"
    done
}
