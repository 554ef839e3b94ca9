#!/usr/bin/env bash
# Runs the security suite: each attack of the threat model (docs/security.md) as a
# test against real agents (or the real part it targets), with the race
# detector. Fails when a listed test no longer exists, so the list cannot
# drift from the code.
set -euo pipefail
cd "$(dirname "$0")/.."
tests=(
  # membership: the gossip key alone admits no server
  TestGossipKeyAloneAdmitsNoServer TestNodeProof TestAgentName TestAdmission
  TestReconcileAdmitsOnlyProvenServers TestBootstrapCountsOnlyProvenServers TestServerByID
  # nothing is read before authentication; bounds on what a caller holds
  TestNothingIsReadBeforeAuthentication TestSlowBodiesAreCut TestStreamsPerCallerAreBounded
  TestFailedAuthenticationFlood TestFailedAuthenticationConcurrent
  # restores obey the write path; archives are verified before anything is built
  TestRestoreObeysTheWritePath TestVerifyChecksSumsFirst TestVerifyWithinRefusesABomb TestInspectDirRefusesHostileFiles
  TestSnapshotFilesMustBeRegular
  # RBAC: roles, conditions, paging through the proxy, identities taken whole
  TestAccessRoles TestAccessOwnerCondition TestListConditionsTakeTheIdentityWhole
  # TLS, key files, the management port, log floods
  TestHandshakes TestStartRefusesBadTLS TestKeyPermissions TestManagementCallers
  TestDebugVarsWithoutCommandLine TestGossipLogLinesKeyOnTheEvent
  # the development OIDC issuer: loopback only, its secret required, another key's tokens refused,
  # wrong secrets limited; http:// issuers only for development
  TestDevIssuerAndToken TestDevIssuerTokens TestLogin TestWrongSecretsAreLimited TestValidate
  # one agent's key acts only as its node; callers relayed and checked where they execute;
  # one cluster's key on a shared CA is refused by the others
  TestAgentCertificateActsOnlyAsItsNode TestAnotherClusterOnTheSameCAIsRefused TestPlacementKeepsAccessControl
  TestIssueWithToken TestRenewalRetiresTheRenewed TestRevokedCertificates
  # plans and inspections refused on declared sizes; proxied bodies to the documented limit;
  # the audit trail is not a log level; OIDC keys replaced under their ID; OCSP signing budget;
  # gossip members that never proved their name are forgotten
  TestPlanRestoreRefusesABomb TestProxiedBodiesKeepTheDocumentedLimit TestAuditIsNotALogLevel
  TestOIDCKeyReplacedUnderItsID TestOCSPSigningBudget TestReapForgetsUnprovenMembersSooner
)
pattern="^($(IFS='|'; echo "${tests[*]}"))\$"
found=$(go test -list "$pattern" ./... | grep -E '^Test' | sort -u)
missing=()
for t in "${tests[@]}"; do
  grep -qx "$t" <<<"$found" || missing+=("$t")
done
if ((${#missing[@]})); then
  echo "security suite: no such test: ${missing[*]}" >&2
  exit 1
fi
go test -race -count=1 -timeout 20m -run "$pattern" ./...
