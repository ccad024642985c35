package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/rules"
	"gopkg.in/yaml.v3"
	sigsyaml "sigs.k8s.io/yaml"
)

// The unit tests, as `promtool test rules` reads them (its rule_files are
// the PrometheusRule's groups instead).
type unitTests struct {
	EvaluationInterval model.Duration `yaml:"evaluation_interval"`
	Tests              []testGroup    `yaml:"tests"`
}

type testGroup struct {
	Name           string          `yaml:"name"`
	Interval       model.Duration  `yaml:"interval"`
	InputSeries    []inputSeries   `yaml:"input_series"`
	AlertRuleTests []alertRuleTest `yaml:"alert_rule_test"`
}

type inputSeries struct {
	Series string `yaml:"series"`
	Values string `yaml:"values"`
}

type alertRuleTest struct {
	EvalTime  model.Duration `yaml:"eval_time"`
	Alertname string         `yaml:"alertname"`
	ExpAlerts []expAlert     `yaml:"exp_alerts"`
}

type expAlert struct {
	ExpLabels      map[string]string `yaml:"exp_labels"`
	ExpAnnotations map[string]string `yaml:"exp_annotations"`
}

func rulesMain(args []string) error {
	flags := flag.NewFlagSet("rules", flag.ContinueOnError)
	ruleFile := flags.String("rule-file", "", "the PrometheusRule manifest")
	testFile := flags.String("tests", "", "the unit tests")
	if err := flags.Parse(args); err != nil {
		return err
	}
	alerting, err := loadRules(*ruleFile)
	if err != nil {
		return fmt.Errorf("%s: %w", *ruleFile, err)
	}
	text, err := os.ReadFile(*testFile)
	if err != nil {
		return err
	}
	var tests unitTests
	dec := yaml.NewDecoder(bytes.NewReader(text))
	dec.KnownFields(true)
	if err := dec.Decode(&tests); err != nil {
		return fmt.Errorf("%s: %w", *testFile, err)
	}
	if tests.EvaluationInterval == 0 {
		tests.EvaluationInterval = model.Duration(time.Minute)
	}
	tested := map[string]bool{}
	var failed []string
	for _, g := range tests.Tests {
		errs := runGroup(g, alerting, time.Duration(tests.EvaluationInterval))
		for _, t := range g.AlertRuleTests {
			tested[t.Alertname] = true
		}
		for _, e := range errs {
			failed = append(failed, fmt.Sprintf("%s: %v", g.Name, e))
		}
		fmt.Printf("%-60s %s\n", g.Name, map[bool]string{true: "ok", false: "FAILED"}[len(errs) == 0])
	}
	// Every alert shipped is tested.
	for _, r := range alerting {
		if !tested[r.alert] {
			failed = append(failed, fmt.Sprintf("alert %s has no unit test", r.alert))
		}
	}
	if len(failed) > 0 {
		return errors.New(strings.Join(failed, "\n"))
	}
	return nil
}

// alertRule is one alert of the PrometheusRule, parsed.
type alertRule struct {
	alert               string
	expr                parser.Expr
	hold                time.Duration
	labels, annotations labels.Labels
}

// loadRules decodes the PrometheusRule strictly (an unknown field, a
// wrong kind or a rule that does not parse is an error) and returns its
// alerts; the shipped rules record nothing.
func loadRules(path string) ([]alertRule, error) {
	text, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	js, err := sigsyaml.YAMLToJSON(text)
	if err != nil {
		return nil, err
	}
	var pr monitoringv1.PrometheusRule
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&pr); err != nil {
		return nil, fmt.Errorf("not a PrometheusRule by prometheus-operator's types: %w", err)
	}
	if pr.APIVersion != "monitoring.coreos.com/v1" || pr.Kind != monitoringv1.PrometheusRuleKind {
		return nil, fmt.Errorf("apiVersion/kind %s/%s", pr.APIVersion, pr.Kind)
	}
	p := parser.NewParser(parser.Options{})
	var out []alertRule
	for _, g := range pr.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				return nil, fmt.Errorf("group %s: a rule that is not an alert", g.Name)
			}
			expr, err := p.ParseExpr(r.Expr.String())
			if err != nil {
				return nil, fmt.Errorf("alert %s: %w", r.Alert, err)
			}
			var hold time.Duration
			if r.For != nil {
				d, err := model.ParseDuration(string(*r.For))
				if err != nil {
					return nil, fmt.Errorf("alert %s: for: %w", r.Alert, err)
				}
				hold = time.Duration(d)
			}
			merged := map[string]string{}
			for k, v := range g.Labels {
				merged[k] = v
			}
			for k, v := range r.Labels {
				merged[k] = v
			}
			out = append(out, alertRule{
				alert:       r.Alert,
				expr:        expr,
				hold:        hold,
				labels:      labels.FromMap(merged),
				annotations: labels.FromMap(r.Annotations),
			})
		}
	}
	return out, nil
}

// runGroup loads the group's input series, evaluates every alert at each
// evaluation interval as Prometheus's rule manager does, and compares the
// firing alerts at each eval_time with those expected.
func runGroup(g testGroup, alerting []alertRule, every time.Duration) []error {
	s, err := openStore()
	if err != nil {
		return []error{err}
	}
	defer s.close()
	interval := time.Duration(g.Interval)
	if interval == 0 {
		interval = every
	}
	p := parser.NewParser(parser.Options{})
	app := s.db.Appender(context.Background())
	for _, in := range g.InputSeries {
		lbls, values, err := p.ParseSeriesDesc(in.Series + " " + in.Values)
		if err != nil {
			return []error{fmt.Errorf("series %s: %w", in.Series, err)}
		}
		for i, v := range values {
			if v.Omitted {
				continue
			}
			t := (time.Duration(i) * interval).Milliseconds()
			if _, err := app.Append(0, lbls, t, v.Value); err != nil {
				return []error{err}
			}
		}
	}
	if err := app.Commit(); err != nil {
		return []error{err}
	}
	query := rules.EngineQueryFunc(s.engine, s.db)
	live := make([]*rules.AlertingRule, len(alerting))
	for i, r := range alerting {
		live[i] = rules.NewAlertingRule(r.alert, r.expr, r.hold, 0, r.labels, r.annotations, labels.EmptyLabels(), "", true, nil)
	}
	var end time.Duration
	checks := map[time.Duration][]alertRuleTest{}
	for _, t := range g.AlertRuleTests {
		at := time.Duration(t.EvalTime)
		checks[at] = append(checks[at], t)
		end = max(end, at)
	}
	var errs []error
	for ts := time.Duration(0); ts <= end; ts += every {
		now := time.Unix(0, 0).UTC().Add(ts)
		for _, r := range live {
			if _, err := r.Eval(context.Background(), 0, now, query, nil, 0); err != nil {
				errs = append(errs, fmt.Errorf("%s at %s: %w", r.Name(), ts, err))
			}
		}
		for _, t := range checks[ts] {
			if err := check(t, live, ts); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errs
}

// check compares the alerts named t.Alertname firing now with t's: their
// labels, and their expanded annotations where the test gives any.
func check(t alertRuleTest, live []*rules.AlertingRule, ts time.Duration) error {
	annotated := slices.ContainsFunc(t.ExpAlerts, func(e expAlert) bool { return len(e.ExpAnnotations) > 0 })
	var got []string
	for _, r := range live {
		if r.Name() != t.Alertname {
			continue
		}
		for _, a := range r.ActiveAlerts() {
			if a.State != rules.StateFiring {
				continue
			}
			var annotations map[string]string
			if annotated {
				annotations = a.Annotations.Map()
			}
			got = append(got, describe(a.Labels.Map(), annotations))
		}
	}
	var want []string
	for _, e := range t.ExpAlerts {
		l := map[string]string{"alertname": t.Alertname}
		for k, v := range e.ExpLabels {
			l[k] = v
		}
		want = append(want, describe(l, e.ExpAnnotations))
	}
	sort.Strings(got)
	sort.Strings(want)
	if !slices.Equal(got, want) {
		return fmt.Errorf("%s at %s:\n  want %v\n  got  %v", t.Alertname, ts, want, got)
	}
	return nil
}

// describe is labels and, where the test names them, annotations.
func describe(l, annotations map[string]string) string {
	s := labels.FromMap(l).String()
	if len(annotations) > 0 {
		s += " " + labels.FromMap(annotations).String()
	}
	return s
}
