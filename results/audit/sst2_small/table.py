import json, pathlib
root = pathlib.Path("runs/audit_sst2")  # run from the repository root
order = ["nonprivate_lora", "monolithic_lora_eps1", "raptor_eps1", "monolithic_lora_eps8", "raptor_eps8"]
print("| run | epsilon claimed | shared / all bound (f-DP) | expert bound (f-DP), stream epsilon | canary AUROC | MIA AUROC | TPR @ 0.1% FPR | dev acc |")
print("|---|---|---|---|---|---|---|---|")
for name in order:
  p = root / name / "audit.json"
  if not p.exists():
    print(f"| {name} | not finished | | | | | | |"); continue
  d = json.loads(p.read_text())
  main = d.get("shared") or d.get("all")
  ex = d.get("expert")
  eps = d.get("epsilon_claimed")
  eps = "none" if eps is None else f"{eps:.3f}"
  exs = "-" if not ex else f"{ex['epsilon_lower_bound']:.3f} ({ex['epsilon_lower_bound_fdp']:.3f}), {ex['epsilon_stream']:.3f}"
  au = f"{main['auroc']:.3f}" + ("" if not ex else f" / {ex['auroc']:.3f}")
  mia = d["membership_inference"]
  print(f"| {name} | {eps} | {main['epsilon_lower_bound']:.3f} ({main['epsilon_lower_bound_fdp']:.3f}) | {exs} | {au} | {mia['auroc']:.3f} | {mia['tpr_at_fpr']['0.001']:.4f} | {d.get('dev_accuracy', float('nan')):.3f} |")
