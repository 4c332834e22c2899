-- Argo CD health check for rlhf.dev/RLHFJob. Install it in argocd-cm as
--   resource.customizations.health.rlhf.dev_RLHFJob: |
--     <this file>
-- It reads the kstatus-style conditions the operator writes (Ready, Reconciling, Stalled) and the phase.
local hs = {}
local st = obj.status
if st == nil or st.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the rlhf-operator to observe the job"
  return hs
end
if st.observedGeneration ~= nil and obj.metadata.generation ~= nil and st.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end
local cond = {}
if st.conditions ~= nil then
  for _, c in ipairs(st.conditions) do
    cond[c.type] = c
  end
end
local msg = st.message or ""
if st.phase == "Failed" or (cond.Stalled ~= nil and cond.Stalled.status == "True") then
  hs.status = "Degraded"
  hs.message = msg
  return hs
end
if st.phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = msg
  return hs
end
if st.phase == "Succeeded" or st.phase == "Running" then
  hs.status = "Healthy"
  if st.step ~= nil and st.totalSteps ~= nil then
    hs.message = st.phase .. ": step " .. st.step .. "/" .. st.totalSteps
  else
    hs.message = msg
  end
  return hs
end
hs.status = "Progressing"
hs.message = msg
return hs
