// Package operator is the PiTrust Kubernetes operator (pitrust operator):
// it reconciles certz.pilab.hu/v1alpha1 ManagedCertificate resources into
// kubernetes.io/tls Secrets issued by the PiTrust CA server (or offline by
// an X1 intermediate kept in a Secret), renews them before expiry with a
// new key, re-issues them when the spec changes or the Secret is deleted
// or tampered with, and revokes what it replaces or what its resource no
// longer needs. See DESIGN.md.
package operator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
	"pilab.hu/pivirt-agent/identity"
)

// Config is pitrust operator's flags.
type Config struct {
	// Kubeconfig is a kubeconfig file; empty: in-cluster, or $KUBECONFIG.
	Kubeconfig string
	// Namespace is the operator's own namespace: its Lease and credential
	// Secret live there.
	Namespace string
	// WatchNamespace limits the operator to one namespace (empty: all).
	WatchNamespace string
	// CAServer and CABundleFile are the default issuer (a resource's
	// issuerRef.url and caBundle override them).
	CAServer     string
	CABundleFile string
	// CertFile and KeyFile are the operator's certificate with the
	// pitrust-admin role; or BootstrapTokenFile a one-time token for it,
	// the certificate then kept in CredentialsSecret.
	CertFile, KeyFile  string
	BootstrapTokenFile string
	CredentialsSecret  string
	// MetricsAddr and HealthAddr: Prometheus metrics (/metrics) and the
	// probes (/healthz, /readyz); "0" turns one off.
	MetricsAddr, HealthAddr string
	// LeaderElect makes replicas elect one leader through a Lease
	// (LeaderElectionID), which alone issues.
	LeaderElect      bool
	LeaderElectionID string
	// LeaseDuration is how long a leader's Lease holds (RenewDeadline and
	// RetryPeriod follow it).
	LeaseDuration time.Duration
	// PolicyFile is the issuance policy (LoadPolicy); empty: only
	// Namespace's resources are served.
	PolicyFile string
	// RevocationDelay is how long a replaced certificate stays valid
	// before it is revoked (pods take up the new Secret meanwhile).
	RevocationDelay time.Duration
	// RetryMin and RetryMax bound the backoff of failed issuances.
	RetryMin, RetryMax time.Duration
	// Workers reconcile in parallel.
	Workers int
	Logger  *slog.Logger
}

// Check validates the flags.
func (c *Config) Check() error {
	switch {
	case c.Namespace == "":
		return errors.New("--namespace is required (the operator's own namespace, for its Lease; in a pod: the POD_NAMESPACE environment variable from the downward API)")
	case (c.CertFile == "") != (c.KeyFile == ""):
		return errors.New("--cert and --key go together")
	case c.CertFile != "" && c.BootstrapTokenFile != "":
		return errors.New("--cert/--key and --bootstrap-token-file exclude each other: give the operator a certificate, or a token to get one")
	case c.BootstrapTokenFile != "" && (c.CAServer == "" || c.CABundleFile == ""):
		return errors.New("--bootstrap-token-file needs --ca-server and --ca-bundle: the CA server it redeems the token at")
	case c.CAServer != "" && c.CABundleFile == "":
		return errors.New("--ca-server needs --ca-bundle: the CA chain its certificate is checked against (pitrust never trusts a server on first use)")
	case c.RetryMin <= 0 || c.RetryMax < c.RetryMin:
		return fmt.Errorf("--retry-min %s and --retry-max %s: want 0 < min <= max", c.RetryMin, c.RetryMax)
	case c.LeaseDuration < 2*time.Second:
		return fmt.Errorf("--lease-duration %s: at least 2s", c.LeaseDuration)
	case c.RevocationDelay < 0:
		return fmt.Errorf("--revocation-delay %s: must not be negative", c.RevocationDelay)
	}
	return nil
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
		}
		return cfg, nil
	}
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return nil, fmt.Errorf("no Kubernetes API: not in a pod and no --kubeconfig or $KUBECONFIG: %w", err)
	}
	return cfg, nil
}

// Scheme holds the types the operator reads and writes.
func Scheme() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		return nil, err
	}
	return s, nil
}

// Run runs the operator until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if err := cfg.Check(); err != nil {
		return err
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.Default()
	}
	ctrl.SetLogger(logr.FromSlogHandler(logger.Handler()))
	rc, err := restConfig(cfg.Kubeconfig)
	if err != nil {
		return err
	}
	rc.UserAgent = "pitrust-operator"
	scheme, err := Scheme()
	if err != nil {
		return err
	}
	bundle, err := readBundle(cfg.CABundleFile)
	if err != nil {
		return err
	}
	policy, err := LoadPolicy(cfg.PolicyFile, cfg.Namespace)
	if err != nil {
		return err
	}
	managed, err := labels.NewRequirement(labelCertificate, selection.Exists, nil)
	if err != nil {
		return err
	}
	cacheOpts := cache.Options{ByObject: map[client.Object]cache.ByObject{
		// Only the Secrets the operator made: not every Secret of the
		// cluster in its memory.
		&corev1.Secret{}: {Label: labels.NewSelector().Add(*managed)},
	}}
	if cfg.WatchNamespace != "" {
		cacheOpts.DefaultNamespaces = map[string]cache.Config{cfg.WatchNamespace: {}}
	}
	lease := cfg.LeaseDuration
	renew := lease * 2 / 3
	retry := lease / 5
	mgr, err := ctrl.NewManager(rc, ctrl.Options{
		Scheme:                        scheme,
		Logger:                        logr.FromSlogHandler(logger.Handler()),
		Cache:                         cacheOpts,
		Metrics:                       metricsserver.Options{BindAddress: cfg.MetricsAddr},
		HealthProbeBindAddress:        cfg.HealthAddr,
		LeaderElection:                cfg.LeaderElect,
		LeaderElectionID:              cfg.LeaderElectionID,
		LeaderElectionNamespace:       cfg.Namespace,
		LeaderElectionReleaseOnCancel: true,
		LeaseDuration:                 &lease,
		RenewDeadline:                 &renew,
		RetryPeriod:                   &retry,
	})
	if err != nil {
		return fmt.Errorf("start the operator: %w", err)
	}
	creds := &credentials{logger: logger}
	switch {
	case cfg.CertFile != "":
		src, err := identity.NewSource(identity.SourceConfig{CertFile: cfg.CertFile, KeyFile: cfg.KeyFile, CAFile: cfg.CABundleFile, Logger: logger})
		if err != nil {
			return fmt.Errorf("--cert/--key: %w", err)
		}
		creds.src = src
		if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error { src.Watch(ctx, 5*time.Second); return nil })); err != nil {
			return err
		}
	case cfg.BootstrapTokenFile != "":
		creds.tokenFile, creds.caURL, creds.bundle = cfg.BootstrapTokenFile, cfg.CAServer, bundle
		creds.secret = types.NamespacedName{Namespace: cfg.Namespace, Name: cfg.CredentialsSecret}
		creds.kube, creds.reader = mgr.GetClient(), mgr.GetAPIReader()
		if err := mgr.Add(creds); err != nil {
			return err
		}
	}
	r := &Reconciler{
		Client: mgr.GetClient(), Reader: mgr.GetAPIReader(),
		Issuers: &issuers{reader: mgr.GetAPIReader(), defaultURL: cfg.CAServer, defaultBundle: bundle, creds: creds},
		Policy:  policy,
		Events:  mgr.GetEventRecorder("pitrust-operator"),
		Metrics: newMetrics(ctrlmetrics.Registry),
		Logger:  logger, RevocationDelay: cfg.RevocationDelay, RetryMin: cfg.RetryMin, RetryMax: cfg.RetryMax, Now: time.Now,
	}
	err = ctrl.NewControllerManagedBy(mgr).
		Named("managedcertificate").
		For(&v1alpha1.ManagedCertificate{}, builder.WithPredicates(predicate.Or(predicate.GenerationChangedPredicate{}, predicate.AnnotationChangedPredicate{}))).
		Owns(&corev1.Secret{}).
		WithOptions(controller.Options{
			MaxConcurrentReconciles: max(cfg.Workers, 1),
			RateLimiter:             workqueue.NewTypedItemExponentialFailureRateLimiter[reconcile.Request](cfg.RetryMin, cfg.RetryMax),
		}).
		Complete(r)
	if err != nil {
		return err
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return err
	}
	// Ready once the caches are filled: a replica that is not the leader
	// is ready too (it stands by).
	if err := mgr.AddReadyzCheck("caches", func(req *http.Request) error {
		ctx, cancel := context.WithTimeout(req.Context(), time.Second)
		defer cancel()
		if !mgr.GetCache().WaitForCacheSync(ctx) {
			return errors.New("caches not synced")
		}
		return nil
	}); err != nil {
		return err
	}
	logger.Info("pitrust operator starting", "namespace", cfg.Namespace, "watch_namespace", cfg.WatchNamespace, "ca_server", cfg.CAServer,
		"leader_elect", cfg.LeaderElect, "metrics", cfg.MetricsAddr, "health", cfg.HealthAddr)
	return mgr.Start(ctx)
}
