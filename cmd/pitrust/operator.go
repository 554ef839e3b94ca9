package main

import (
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/cmd/internal/operator"
)

func operatorCmd(stderr io.Writer) *cobra.Command {
	cfg := operator.Config{}
	c := &cobra.Command{
		Use:   "operator",
		Short: "Run the PiTrust Kubernetes operator: ManagedCertificate resources become TLS Secrets, renewed before expiry",
		Long: `Run the PiTrust Kubernetes operator. It reconciles certz.pilab.hu/v1alpha1
ManagedCertificate resources into kubernetes.io/tls Secrets (tls.crt: the
certificate and the X1 intermediate; tls.key; ca.crt: the intermediate and the
root) issued by the PiTrust CA server (pitrust serve) — or offline by an X1
intermediate kept in a Secret (issuerRef.secretName) — and renews each one
renewBefore (default 720h) before it expires, with a new key, in place: pods
that mount the Secret see the new files without a restart. A certificate is
issued again when the spec changes or the Secret is deleted or tampered with;
deleting a resource revokes its certificate at the CA server
(revocationPolicy).

The operator authenticates to the CA server with a certificate of the
pitrust-admin role (--cert, --key), or gets one with a one-time bootstrap
token (--bootstrap-token-file; pitrust token create --name NAME --kind
mtls-client) and keeps it in the Secret --credentials-secret of its namespace,
renewed at two thirds of its life. That credential may issue any name, so
the operator serves only the resources of its own namespace unless an
issuance policy (--policy) grants other namespaces their names. Replicas elect a leader through a Lease
(--leader-elect): only the leader issues. Metrics on --metrics-addr
(/metrics), probes on --health-addr (/healthz, /readyz); both loopback unless
set. Logs are JSON lines on stderr. The CRD, RBAC, a Deployment and an
example are in deploy/operator/ of the source tree.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.Namespace == "" {
				cfg.Namespace = os.Getenv("POD_NAMESPACE")
			}
			if err := cfg.Check(); err != nil {
				return &usageError{err}
			}
			cfg.Logger = slog.New(slog.NewJSONHandler(stderr, nil))
			return operator.Run(cmd.Context(), cfg)
		},
	}
	f := c.Flags()
	f.StringVar(&cfg.Kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster, or $KUBECONFIG)")
	f.StringVar(&cfg.Namespace, "namespace", "", "the operator's own namespace, for its Lease and credential Secret (default $POD_NAMESPACE)")
	f.StringVar(&cfg.WatchNamespace, "watch-namespace", "", "reconcile only this namespace's resources (default: all)")
	f.StringVar(&cfg.CAServer, "ca-server", "", "URL of the default PiTrust CA server, e.g. https://pitrust.pivirt-system.svc:8080 (a resource's issuerRef.url overrides it)")
	f.StringVar(&cfg.CABundleFile, "ca-bundle", "", "PEM file of the CAs the CA server's certificate must chain to (ca-chain.pem)")
	f.StringVar(&cfg.CertFile, "cert", "", "the operator's client certificate with the pitrust-admin role (reread when it changes)")
	f.StringVar(&cfg.KeyFile, "key", "", "key of --cert")
	f.StringVar(&cfg.BootstrapTokenFile, "bootstrap-token-file", "", "file holding a one-time bootstrap token for the operator's certificate (instead of --cert/--key)")
	f.StringVar(&cfg.CredentialsSecret, "credentials-secret", "pitrust-operator-credentials", "Secret of --namespace keeping the certificate got with the bootstrap token")
	f.StringVar(&cfg.MetricsAddr, "metrics-addr", "127.0.0.1:8080", `Prometheus metrics (/metrics) on this host:port ("0": off)`)
	f.StringVar(&cfg.HealthAddr, "health-addr", "127.0.0.1:8081", `health (/healthz) and readiness (/readyz) probes on this host:port ("0": off)`)
	f.BoolVar(&cfg.LeaderElect, "leader-elect", true, "elect one leader among replicas through a Lease; only the leader issues")
	f.StringVar(&cfg.LeaderElectionID, "leader-election-id", "pitrust-operator.certz.pilab.hu", "name of the Lease")
	f.DurationVar(&cfg.LeaseDuration, "lease-duration", 15*time.Second, "how long a leader's Lease holds without renewal (a stopped leader releases it at once)")
	f.StringVar(&cfg.PolicyFile, "policy", "", "issuance policy (YAML): which namespaces may ask for which names (default: only --namespace's resources are served)")
	f.DurationVar(&cfg.RevocationDelay, "revocation-delay", 2*time.Minute, "how long a replaced certificate stays valid before it is revoked, so that pods take up the new Secret first")
	f.DurationVar(&cfg.RetryMin, "retry-min", time.Second, "first retry delay after a failed issuance (doubling, jittered)")
	f.DurationVar(&cfg.RetryMax, "retry-max", 5*time.Minute, "longest retry delay after failed issuances")
	f.IntVar(&cfg.Workers, "workers", 4, "resources reconciled in parallel")
	return c
}
